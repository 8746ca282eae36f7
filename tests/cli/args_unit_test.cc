// The command-line parser: what each subcommand accepts, and the one-line usage errors a user
// sees for everything else.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/args.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap::args {
namespace {

using namespace gpusnap::testing;  // testing/unit.h
using Strings = std::vector<std::string>;

const std::vector<FlagSpec> kSpecs = {
    {"--output", "-o", "PATH", "where to write the artifact"},
    {"--verbose", "-v", "", "say more"},
    {"--publish", "-p", "SPEC", "publish a port of each copy", /*repeatable=*/true},
    {"--replicas", "-n", "N", "how many copies"},
    {"--criu", "", "PATH", "the criu binary"},
};

Args parse(const Strings& argv) { return Args("checkpoint", kSpecs, argv); }

// Parses argv, which must be refused, and returns the usage error.
Error refuse(const Strings& argv) {
  Error e = catch_error([&] { parse(argv); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_EQ(e.hint(), "see `gpusnap checkpoint --help`");
  return e;
}

TEST(ArgsTest, FlagsWithValues) {
  Args a = parse({"--output", "/snap", "--criu", "/opt/criu"});
  EXPECT_TRUE(a.has("--output"));
  EXPECT_EQ(a.get("--output"), "/snap");
  EXPECT_EQ(a.get("--criu"), "/opt/criu");
  EXPECT_FALSE(a.has("--verbose"));
  EXPECT_FALSE(a.has("--replicas"));
  EXPECT_EQ(a.get("--replicas"), "");
  EXPECT_EQ(a.get("--replicas", "1"), "1");
  EXPECT_TRUE(a.positional().empty());
  EXPECT_TRUE(a.rest().empty());
}

TEST(ArgsTest, InlineValues) {
  Args a = parse({"--output=/snap", "--criu=", "--publish=a=b"});
  EXPECT_EQ(a.get("--output"), "/snap");
  EXPECT_TRUE(a.has("--criu"));
  EXPECT_EQ(a.get("--criu", "fallback"), "") << "an empty inline value is a value";
  EXPECT_EQ(a.get("--publish"), "a=b") << "only the first '=' separates";
}

TEST(ArgsTest, ShortFlagsStoreUnderTheLongName) {
  Args a = parse({"-o", "/snap", "-v", "-n", "3"});
  EXPECT_EQ(a.get("--output"), "/snap");
  EXPECT_TRUE(a.has("--verbose"));
  EXPECT_EQ(a.get("--verbose"), "1");
  EXPECT_EQ(a.get("--replicas"), "3");
  EXPECT_FALSE(a.has("-o"));
}

TEST(ArgsTest, ValueMayLookLikeAFlag) {
  Args a = parse({"--output", "-v"});
  EXPECT_EQ(a.get("--output"), "-v");
  EXPECT_FALSE(a.has("--verbose"));
}

TEST(ArgsTest, RepeatableFlagCollectsInOrder) {
  Args a = parse({"-p", "80", "--publish=9000:90", "--verbose", "--publish", "100"});
  EXPECT_EQ(a.all("--publish"), (Strings{"80", "9000:90", "100"}));
  EXPECT_EQ(a.get("--publish"), "100");
  EXPECT_EQ(a.all("--output"), Strings{});
  EXPECT_EQ(a.all("--verbose"), Strings{"1"});
}

TEST(ArgsTest, BooleanFlagRefusesAValue) {
  EXPECT_STREQ(refuse({"--verbose=yes"}).what(), "--verbose takes no value");
  EXPECT_STREQ(refuse({"--verbose="}).what(), "--verbose takes no value");
}

TEST(ArgsTest, UnknownFlagIsNamed) {
  EXPECT_STREQ(refuse({"--bogus"}).what(), "unknown option --bogus for checkpoint");
  EXPECT_STREQ(refuse({"--bogus=1"}).what(), "unknown option --bogus for checkpoint");
  EXPECT_STREQ(refuse({"-x"}).what(), "unknown option -x for checkpoint");
  EXPECT_STREQ(refuse({"-o=/snap"}).what(), "unknown option -o=/snap for checkpoint");
  EXPECT_STREQ(refuse({"--out", "/snap"}).what(), "unknown option --out for checkpoint")
      << "no prefix matching";
  EXPECT_STREQ(refuse({"1234", "---output"}).what(), "unknown option ---output for checkpoint");
}

TEST(ArgsTest, MissingValueNamesTheFlagAndWhatItNeeds) {
  EXPECT_STREQ(refuse({"--output"}).what(), "--output needs a PATH");
  EXPECT_STREQ(refuse({"-v", "-n"}).what(), "--replicas needs a N");
}

TEST(ArgsTest, NonRepeatableFlagGivenTwice) {
  EXPECT_STREQ(refuse({"-o", "/a", "--output", "/b"}).what(), "--output given twice");
  EXPECT_STREQ(refuse({"-v", "--verbose"}).what(), "--verbose given twice");
  EXPECT_STREQ(refuse({"--criu=/a", "--criu=/a"}).what(), "--criu given twice");
}

TEST(ArgsTest, GetInt) {
  Args a = parse({"-n", "3"});
  EXPECT_EQ(a.get_int("--replicas", 1, 1, 64), 3);
  EXPECT_EQ(a.get_int("--criu", 7, 1, 64), 7) << "absent: the fallback, unchecked";
  EXPECT_EQ(parse({"-n", "64"}).get_int("--replicas", 1, 1, 64), 64);
  EXPECT_EQ(parse({"-n", "-5"}).get_int("--replicas", 1, -10, 10), -5);
}

TEST(ArgsTest, GetIntRefusesOutOfRangeAndNonNumbers) {
  for (const char* value : {"0", "65", "-1", "abc", "3x", "", "1.5", "99999999999999999999"}) {
    SCOPED_TRACE(value);
    Args a = parse({std::string("--replicas=") + value});
    Error e = catch_error([&] { a.get_int("--replicas", 1, 1, 64); });
    EXPECT_EQ(e.kind(), ErrorKind::kUsage);
    EXPECT_EQ(std::string(e.what()),
              std::string("--replicas must be a whole number from 1 to 64, not '") + value + "'");
    EXPECT_EQ(e.hint(), "see `gpusnap checkpoint --help`");
  }
}

TEST(ArgsTest, PositionalArgumentsBetweenFlags) {
  Args a = parse({"1234", "-v", "-", "-o", "/snap", "extra"});
  EXPECT_EQ(a.positional(), (Strings{"1234", "-", "extra"}));
  EXPECT_EQ(a.get("--output"), "/snap");
}

TEST(ArgsTest, EverythingAfterDoubleDashIsRest) {
  Args a = parse({"-v", "--", "python3", "--output", "x", "-v", "--"});
  EXPECT_EQ(a.rest(), (Strings{"python3", "--output", "x", "-v", "--"}));
  EXPECT_FALSE(a.has("--output"));
  EXPECT_EQ(a.all("--verbose"), Strings{"1"});
  EXPECT_TRUE(a.positional().empty());
  EXPECT_TRUE(parse({"--"}).rest().empty());
}

TEST(ArgsTest, HelpListsEveryFlag) {
  const std::string help =
      format_help("gpusnap checkpoint PID -o PATH", "Capture a running process tree.", kSpecs);
  EXPECT_EQ(help.rfind("usage: gpusnap checkpoint PID -o PATH\n\nCapture a running process tree."
                       "\n\noptions:\n",
                       0),
            0u)
      << help;
  for (const auto& s : kSpecs) {
    EXPECT_NE(help.find(s.name), std::string::npos) << s.name;
    EXPECT_NE(help.find(s.help), std::string::npos) << s.help;
    if (!s.short_name.empty()) {
      EXPECT_NE(help.find(s.short_name + ", " + s.name), std::string::npos) << s.short_name;
    }
  }
  // Help texts line up in column 30.
  EXPECT_NE(help.find("\n  -o, --output PATH           where to write the artifact\n"),
            std::string::npos)
      << help;
  EXPECT_NE(help.find("\n  -v, --verbose               say more\n"), std::string::npos);
  EXPECT_NE(help.find("\n  --criu PATH                 the criu binary\n"), std::string::npos);
}

TEST(ArgsTest, HelpPutsTheTextOfALongFlagOnTheNextLine) {
  const std::string help =
      format_help("u", "s", {{"--a-very-long-option-name", "", "VALUE", "its help"}});
  EXPECT_EQ(help, "usage: u\n\ns\n\noptions:\n"
                  "  --a-very-long-option-name VALUE\n" +
                      std::string(30, ' ') + "its help\n");
}

}  // namespace
}  // namespace gpusnap::args
