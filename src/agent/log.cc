#include "agent/log.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "common/utc.h"

namespace gpusnap::agent {

namespace {

using nlohmann::json;
// A line's fields in the order written: time and event first, as a reader scans them.
using Fields = nlohmann::ordered_json;

// What the operation is about, from its request: the fields an operator looks for.
json subject_of(const Operation& op) {
  json out = json::object();
  for (const char* key : {"artifact", "reference", "pid"}) {
    if (op.request.is_object() && op.request.contains(key)) out[key] = op.request[key];
  }
  return out;
}

// "artifact snap, pid 4242": the subject in a text line.
std::string subject_text(const json& subject) {
  std::string out;
  for (const auto& [key, value] : subject.items()) {
    out += (out.empty() ? "" : ", ") + key + " " +
           (value.is_string() ? value.get<std::string>() : value.dump());
  }
  return out;
}

// "usage: MESSAGE (fix: HINT)": an error object in a text line.
std::string error_text(const json& error) {
  std::string out = error.value("kind", "?") + ": " + error.value("message", "");
  if (auto hint = error.value("hint", ""); !hint.empty()) out += " (fix: " + hint + ")";
  return out;
}

// The error object as the log carries it: the API's without its exit code, which the kind
// already names.
Fields logged_error(const json& error) {
  return {{"kind", error.value("kind", "?")},
          {"message", error.value("message", "")},
          {"hint", error.value("hint", "")}};
}

std::string seconds_text(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", seconds);
  return buf;
}

}  // namespace

LogFormat log_format_from_name(const std::string& name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  throw Error(ErrorKind::kUsage, "bad --log-format '" + name + "'", "use text or json");
}

EventLog::EventLog(LogFormat format, int fd) : format_(format), fd_(fd) {}

void EventLog::agent(std::string_view message) const {
  write({{"event", "agent"}, {"message", message}}, std::string(message));
}

void EventLog::request(std::string_view method, std::string_view path, int status,
                       const json& error) const {
  Fields fields = {{"event", "request"}, {"method", method}, {"path", path}, {"status", status}};
  std::string text =
      std::string(method) + " " + std::string(path) + " -> " + std::to_string(status);
  if (error.is_object()) {
    fields["error"] = logged_error(error);
    text += ": " + error_text(error);
  }
  write(std::move(fields), text);
}

void EventLog::operation_started(const Operation& op) const {
  const json subject = subject_of(op);
  Fields fields = {{"event", "operation-started"}, {"id", op.id}, {"kind", kind_name(op.kind)}};
  for (const auto& [key, value] : subject.items()) fields[key] = value;
  std::string text = "operation " + op.id + " " + kind_name(op.kind) + " started";
  if (!subject.empty()) text += " (" + subject_text(subject) + ")";
  write(std::move(fields), text);
}

void EventLog::operation_finished(const Operation& op, OperationState outcome, const json& error,
                                  std::optional<double> seconds) const {
  const std::string outcome_name = state_name(outcome);
  const json subject = subject_of(op);
  Fields fields = {{"event", "operation-finished"},
                   {"id", op.id},
                   {"kind", kind_name(op.kind)},
                   {"outcome", outcome_name},
                   {"duration_s", seconds ? Fields(*seconds) : Fields()}};
  for (const auto& [key, value] : subject.items()) fields[key] = value;
  std::string text = "operation " + op.id + " " + kind_name(op.kind) + " " + outcome_name;
  if (seconds) text += " in " + seconds_text(*seconds) + " s";
  if (!subject.empty()) text += " (" + subject_text(subject) + ")";
  if (error.is_object()) {
    fields["error"] = logged_error(error);
    text += ": " + error_text(error);
  }
  write(std::move(fields), text);
}

void EventLog::fatal(const Error& error) const {
  if (format_ == LogFormat::kText) {
    const std::string line = "gpusnap-agent: error: " + error.one_line() + "\n";
    std::lock_guard lock(mu_);
    (void)!::write(fd_, line.data(), line.size());
    return;
  }
  write({{"event", "agent"}, {"error", logged_error(error_json(error))}}, {});
}

void EventLog::write(Fields fields, const std::string& text) const {
  const std::string time = utc::now(utc::Precision::kMilliseconds);
  std::string line;
  if (format_ == LogFormat::kJson) {
    Fields ordered = {{"time", time}};
    for (auto& [key, value] : fields.items()) ordered[key] = std::move(value);
    // Messages may quote a caller's bytes: invalid UTF-8 is replaced, not thrown on.
    line = ordered.dump(-1, ' ', false, Fields::error_handler_t::replace);
  } else {
    line = time + " gpusnap-agent: " + text;
  }
  line += '\n';
  std::lock_guard lock(mu_);
  // A log line that cannot be written (a closed or full stderr) is dropped: the operation
  // it tells of must not fail for it.
  for (size_t off = 0; off < line.size();) {
    const ssize_t n = ::write(fd_, line.data() + off, line.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

}  // namespace gpusnap::agent
