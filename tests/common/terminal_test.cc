#include "common/terminal.h"

#include <gtest/gtest.h>

namespace gpusnap::common {
namespace {

TEST(TerminalSafe, EscapesWhatDrivesATerminalAndKeepsTheRest) {
  EXPECT_EQ(terminal_safe("plain text\tand\nlines, caf\xc3\xa9"),
            "plain text\tand\nlines, caf\xc3\xa9");
  // Clear screen, window title, OSC 52 clipboard write, DEL, CR.
  EXPECT_EQ(terminal_safe("\x1b[2J\x1b]0;title\x07\x1b]52;c;aGk=\x07\x7f\r"),
            "\\x1b[2J\\x1b]0;title\\x07\\x1b]52;c;aGk=\\x07\\x7f\\x0d");
  // CSI as a C1 control in UTF-8 (U+009B).
  EXPECT_EQ(terminal_safe("a\xc2\x9b"
                          "2Jb"),
            "a\\u009b2Jb");
  EXPECT_EQ(terminal_safe(std::string("nul\0end", 7)), "nul\\x00end");
}

}  // namespace
}  // namespace gpusnap::common
