#include "common/terminal.h"

namespace gpusnap::common {

std::string terminal_safe(std::string_view text) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto ch = static_cast<unsigned char>(text[i]);
    // C0 controls (ESC starts screen and title sequences, OSC 52 writes the clipboard) and DEL;
    // C1 controls as UTF-8 (U+0080..U+009F: CSI, OSC), which some terminals obey too.
    if ((ch < 0x20 && ch != '\n' && ch != '\t') || ch == 0x7f) {
      out += "\\x";
      out += kHex[ch >> 4];
      out += kHex[ch & 15];
    } else if (ch == 0xc2 && i + 1 < text.size() &&
               static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(text[i + 1]) <= 0x9f) {
      const auto c1 = static_cast<unsigned char>(text[++i]);
      out += "\\u00";
      out += kHex[c1 >> 4];
      out += kHex[c1 & 15];
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out;
}

}  // namespace gpusnap::common
