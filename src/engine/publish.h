// Publishing a copy's port on the host (`--publish`): the flag's text, and the listening socket
// each copy's init forwards from (engine/copy_init.h).
#pragma once

#include <cstdint>
#include <string>

#include "common/fd.h"

namespace gpusnap::engine {

// A listening TCP socket on address:port (port 0: any free one); `*bound` gets the port it
// took. Throws Error(kUsage) naming the address when it is not IPv4 or the port is taken.
common::UniqueFd listen_on(const std::string& address, uint16_t port, uint16_t* bound);

}  // namespace gpusnap::engine
