// Text from outside (a registry's manifest, another node's artifact) made safe to show on a
// terminal.
#pragma once

#include <string>
#include <string_view>

namespace gpusnap::common {

// Escapes control characters as \xHH (C0 but newline and tab, and DEL) and \u00HH (C1 as
// UTF-8, U+0080..U+009F), so that the text cannot clear the screen, set the window title or
// write the clipboard (OSC 52). Everything else, UTF-8 included, is kept.
std::string terminal_safe(std::string_view text);

}  // namespace gpusnap::common
