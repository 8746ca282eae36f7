// The agent's log lines (agent/log.h) in both forms, written to a pipe and read back: the exact
// text after the time, and the time itself in UTC with milliseconds.
#include <fcntl.h>
#include <unistd.h>

#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "agent/log.h"
#include "common/fd.h"

namespace gpusnap::agent {
namespace {

using nlohmann::json;

const std::regex kTime(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)");

// Lines a log writes into a pipe, read back after `write` ran.
template <typename Write>
std::vector<std::string> lines_of(LogFormat format, Write write) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  common::UniqueFd read_end(fds[0]);
  {
    common::UniqueFd write_end(fds[1]);
    EventLog log(format, write_end.get());
    write(log);
  }
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(read_end.get(), buf, sizeof buf)) > 0;) text.append(buf, n);
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The text line without its time, which it must open with.
std::string after_time(const std::string& line) {
  std::smatch m;
  EXPECT_TRUE(std::regex_search(line, m, kTime) && m.position(0) == 0) << line;
  return line.substr(std::min<size_t>(line.size(), 25));
}

Operation failed_checkpoint() {
  Operation op;
  op.id = "0123456789abcdef";
  op.kind = OperationKind::kCheckpoint;
  op.state = OperationState::kFailed;
  op.request = {{"artifact", "snap"}, {"pid", 999999}, {"leave_running", true}};
  op.error = error_json(Error(ErrorKind::kNotFound, "no process 999999", "check the pid"));
  return op;
}

TEST(AgentLog, TextLinesOpenWithTheTimeAndSayWhatHappened) {
  Operation op = failed_checkpoint();
  Operation prefetch;
  prefetch.id = "fedcba9876543210";
  prefetch.kind = OperationKind::kPrefetch;
  prefetch.state = OperationState::kSucceeded;
  prefetch.request = {{"reference", "oci://h/r:x"}};
  const auto lines = lines_of(LogFormat::kText, [&](const EventLog& log) {
    log.agent("serving /run/a.sock");
    log.request("POST", "/v1/checkpoints", 202, nullptr);
    log.request("POST", "/v1/prefetch", 429,
                {{"kind", "environment"}, {"message", "full"}, {"hint", "later"}});
    log.operation_started(op);
    log.operation_finished(op, op.state, op.error, 0.0123);
    log.operation_finished(prefetch, prefetch.state, nullptr, 2.5);
    log.operation_finished(op, op.state, op.error, std::nullopt);
  });
  ASSERT_EQ(lines.size(), 7u);
  EXPECT_EQ(after_time(lines[0]), "gpusnap-agent: serving /run/a.sock");
  EXPECT_EQ(after_time(lines[1]), "gpusnap-agent: POST /v1/checkpoints -> 202");
  EXPECT_EQ(after_time(lines[2]),
            "gpusnap-agent: POST /v1/prefetch -> 429: environment: full (fix: later)");
  EXPECT_EQ(after_time(lines[3]),
            "gpusnap-agent: operation 0123456789abcdef checkpoint started (artifact snap, pid "
            "999999)");
  EXPECT_EQ(after_time(lines[4]),
            "gpusnap-agent: operation 0123456789abcdef checkpoint failed in 0.012 s (artifact "
            "snap, pid 999999): not-found: no process 999999 (fix: check the pid)");
  EXPECT_EQ(after_time(lines[5]),
            "gpusnap-agent: operation fedcba9876543210 prefetch succeeded in 2.500 s (reference "
            "oci://h/r:x)");
  EXPECT_EQ(after_time(lines[6]),
            "gpusnap-agent: operation 0123456789abcdef checkpoint failed (artifact snap, pid "
            "999999): not-found: no process 999999 (fix: check the pid)");
}

TEST(AgentLog, JsonLinesCarryTheSameFieldsTimeFirst) {
  Operation op = failed_checkpoint();
  const auto lines = lines_of(LogFormat::kJson, [&](const EventLog& log) {
    log.agent("serving /run/a.sock");
    log.request("POST", "/v1/checkpoints", 400,
                {{"kind", "usage"}, {"exit_code", 2}, {"message", "bad \xff"}, {"hint", ""}});
    log.operation_started(op);
    log.operation_finished(op, op.state, op.error, 0.5);
    log.operation_finished(op, op.state, op.error, std::nullopt);
    log.fatal(Error(ErrorKind::kUsage, "bad flag", "see --help"));
  });
  ASSERT_EQ(lines.size(), 6u);
  std::vector<json> docs;
  for (const auto& line : lines) {
    ASSERT_EQ(line.rfind("{\"time\":\"", 0), 0u) << line;
    docs.push_back(json::parse(line));
    EXPECT_TRUE(std::regex_match(docs.back()["time"].get<std::string>(), kTime)) << line;
    docs.back().erase("time");
  }
  EXPECT_EQ(docs[0], (json{{"event", "agent"}, {"message", "serving /run/a.sock"}}));
  // Invalid UTF-8 of a caller's is replaced: the line stays JSON.
  EXPECT_EQ(docs[1],
            (json{{"event", "request"},
                  {"method", "POST"},
                  {"path", "/v1/checkpoints"},
                  {"status", 400},
                  {"error", {{"kind", "usage"}, {"message", "bad \xef\xbf\xbd"}, {"hint", ""}}}}));
  EXPECT_EQ(docs[2], (json{{"event", "operation-started"},
                           {"id", "0123456789abcdef"},
                           {"kind", "checkpoint"},
                           {"artifact", "snap"},
                           {"pid", 999999}}));
  const json error = {
      {"kind", "not-found"}, {"message", "no process 999999"}, {"hint", "check the pid"}};
  EXPECT_EQ(docs[3], (json{{"event", "operation-finished"},
                           {"id", "0123456789abcdef"},
                           {"kind", "checkpoint"},
                           {"outcome", "failed"},
                           {"duration_s", 0.5},
                           {"artifact", "snap"},
                           {"pid", 999999},
                           {"error", error}}));
  EXPECT_TRUE(docs[4]["duration_s"].is_null()) << lines[4];
  EXPECT_EQ(
      docs[5],
      (json{{"event", "agent"},
            {"error", {{"kind", "usage"}, {"message", "bad flag"}, {"hint", "see --help"}}}}));
}

TEST(AgentLog, TextFatalErrorIsTheCliLine) {
  const auto lines = lines_of(LogFormat::kText, [](const EventLog& log) {
    log.fatal(Error(ErrorKind::kUsage, "bad flag", "see --help"));
  });
  EXPECT_EQ(lines, std::vector<std::string>{"gpusnap-agent: error: bad flag (fix: see --help)"});
}

TEST(AgentLog, FormatNamesAreTextAndJson) {
  EXPECT_EQ(log_format_from_name("text"), LogFormat::kText);
  EXPECT_EQ(log_format_from_name("json"), LogFormat::kJson);
  try {
    log_format_from_name("JSON");
    ADD_FAILURE() << "JSON accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "bad --log-format 'JSON'");
    EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  }
}

}  // namespace
}  // namespace gpusnap::agent
