// The built gpusnap's words about itself: the overview, `help COMMAND`, `version --json`, the
// man pages and the bash completion, all made from the one command table.
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/subprocess.h"
#include "testing/harness.h"
#include "testing/unit.h"

namespace gpusnap::testing {
namespace {

const std::vector<std::string> kCommands{"checkpoint", "run",     "restore", "init",
                                         "recover",    "inspect", "verify",  "list",
                                         "push",       "pull",    "import"};

// The output of a shell command (its stdout and stderr) and its exit code.
CliResult shell(const std::string& script) {
  const auto run = common::run_capture({"/bin/bash", "-c", script});
  return {run.status.exited ? run.status.code : -1, run.output, ""};
}

TEST(CliHelp, HelpCommandDescribesTheCommandNotTheOverview) {
  for (const auto& name : kCommands) {
    auto r = gpusnap({"help", name});
    EXPECT_EQ(r.exit_code, 0) << name << r.err;
    EXPECT_EQ(r.out, gpusnap({name, "--help"}).out) << name;
    EXPECT_EQ(r.out.rfind("usage: gpusnap " + name, 0), 0u) << r.out;
  }
  auto unknown = gpusnap({"help", "snapshot"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.err.find("unknown command 'snapshot'"), std::string::npos) << unknown.err;
}

// The overview cut each summary at its first newline, mid-sentence ("the node cache: chunks
// it holds are not fetched again (a pull that was killed resumes), each").
TEST(CliHelp, OverviewGivesWholeFirstSentences) {
  auto r = gpusnap({"help"});
  ASSERT_EQ(r.exit_code, 0);
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = r.out.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines.push_back(r.out.substr(start, nl - start));
  }
  // Each command's entry: its line and the continuations under it (blanks to the sentence's
  // column), ending with the sentence's full stop.
  std::map<std::string, std::string> entries;
  std::string current;
  for (const auto& line : lines) {
    EXPECT_LE(line.size(), 80u) << line;
    if (line.rfind("  ", 0) == 0 && line.size() > 2 && line[2] != ' ') {
      current = line.substr(2, line.find(' ', 2) - 2);
      entries[current] = line;
    } else if (!current.empty() && line.rfind(std::string(15, ' '), 0) == 0) {
      entries[current] += "\n" + line;
    } else {
      current.clear();
    }
  }
  for (const auto& name : kCommands) {
    ASSERT_TRUE(entries.count(name)) << name << "\n" << r.out;
    EXPECT_EQ(entries[name].back(), '.') << entries[name];
  }
  // Read as one line again, an entry is the whole first sentence of the command's summary.
  std::string push;
  for (char c : entries["push"]) {
    if (c == '\n' || (c == ' ' && !push.empty() && push.back() == ' ')) continue;
    push += c;
  }
  EXPECT_EQ(push, " push Upload an artifact to an OCI registry as content-addressed chunks.");
}

// What a registry that stops answering can cost is said where the flags are.
TEST(CliHelp, PushAndPullStateTheirBoundsAgainstARegistry) {
  for (const char* name : {"push", "pull"}) {
    auto r = gpusnap({name, "--help"});
    EXPECT_EQ(r.exit_code, 0);
    for (const char* said : {"1 + --retries times", "60 s plus 1 s per 64 KiB of its body",
                             "fewer than 1 KiB move in 30 s", "exit 11"}) {
      EXPECT_NE(r.out.find(said), std::string::npos) << name << ": " << said << "\n" << r.out;
    }
  }
}

TEST(CliHelp, VersionSpeaksJson) {
  auto r = gpusnap({"version", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc.at("version"), GPUSNAP_VERSION);
  EXPECT_EQ(gpusnap({"version"}).out, std::string("gpusnap ") + GPUSNAP_VERSION + "\n");
  EXPECT_EQ(gpusnap({"version", "--yaml"}).exit_code, 2);
}

TEST(CliHelp, ManPagesRenderForEveryCommand) {
  TempDir dir;
  auto r = gpusnap({"help", "--man-dir", dir.path().string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "gpusnap.1"));
  for (const auto& name : kCommands) {
    const auto page = dir.path() / ("gpusnap-" + name + ".1");
    ASSERT_TRUE(std::filesystem::exists(page)) << page;
    EXPECT_EQ(std::filesystem::status(page).permissions() & std::filesystem::perms::all,
              std::filesystem::perms(0644));
    // man(1) itself renders it; its warnings (-ww) would name a broken request.
    auto text = shell("MANWIDTH=80 man --warnings -l " + page.string());
    EXPECT_EQ(text.exit_code, 0) << text.out;
    EXPECT_NE(text.out.find("SYNOPSIS"), std::string::npos) << text.out;
    EXPECT_NE(text.out.find("--help"), std::string::npos) << text.out;
    EXPECT_EQ(text.out.find("warning"), std::string::npos) << text.out;
    EXPECT_EQ(gpusnap({"help", "--man", name}).out, fs::read_file(page)) << name;
  }
}

TEST(CliHelp, BashCompletesCommandsAndFlags) {
  auto r = gpusnap({"completion", "bash"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  TempDir dir;
  const auto script = dir.path() / "gpusnap.bash";
  fs::write_file(script, r.out);
  // The completion function, called as bash would for the words typed so far.
  auto complete = [&](const std::string& line) {
    return shell("source " + script.string() + "; COMP_WORDS=(" + line +
                 "); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); _gpusnap; "
                 "printf '%s\\n' \"${COMPREPLY[@]}\"")
        .out;
  };
  EXPECT_EQ(complete("gpusnap pu"), "push\npull\n");
  EXPECT_EQ(complete("gpusnap checkpoint --leave"), "--leave-running\n");
  EXPECT_EQ(complete("gpusnap --agent /run/a.sock restore --replic"), "--replicas\n");
  EXPECT_EQ(complete("gpusnap help ver"), "version\nverify\n");
  EXPECT_EQ(gpusnap({"completion", "zsh"}).exit_code, 2);
}

}  // namespace
}  // namespace gpusnap::testing
