// Percent-encoding for the parts of a URL gpusnap builds (Kubernetes selectors, registry
// digests).
#pragma once

#include <string>
#include <string_view>

namespace gpusnap::common {

// Every byte but RFC 3986's unreserved characters (A-Z a-z 0-9 - _ . ~) as %XX.
std::string url_encode(std::string_view value);

}  // namespace gpusnap::common
