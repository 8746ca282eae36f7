#include "engine/handshake.h"

#include <algorithm>
#include <thread>

#include "common/fs.h"
#include "common/json.h"
#include "common/proc.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

using nlohmann::json;

namespace {

constexpr auto kPoll = std::chrono::milliseconds(10);

void write_message(const std::filesystem::path& dir, const std::string& name, const json& body) {
  auto tmp = dir / (name + ".tmp");
  fs::write_file(tmp, body.dump() + "\n");
  std::filesystem::rename(tmp, dir / name);
}

// The workload writes these files: a message is a small JSON object in a regular file. A
// FIFO, a symlink to /dev/zero, a huge or deeply nested file is no message, and must not block,
// exhaust or crash gpusnap.
constexpr size_t kMaxMessageBytes = 64 << 10;

std::optional<json> read_message(const std::filesystem::path& path) {
  std::string text;
  if (!fs::try_read_regular_file(path, &text, kMaxMessageBytes)) return std::nullopt;
  auto doc = json_text::parse(text);
  if (!doc || !doc->is_object()) return std::nullopt;
  return doc;
}

// A string member of a message, or `fallback`: a workload's "id": 7 is no match, not a crash.
std::string text_of(const json& message, const char* key, const std::string& fallback = "") {
  auto it = message.find(key);
  if (it == message.end() || !it->is_string()) return fallback;
  return it->get_ref<const std::string&>().substr(0, 500);
}

bool alive(pid_t pid) {
  try {
    return proc::read_process(pid).state != 'Z';
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

std::optional<std::filesystem::path> control_dir_of(pid_t pid) {
  auto value = proc::environment_value(pid, kControlDirEnv);
  if (!value || value->empty() || value->front() != '/') return {};
  return std::filesystem::path(*value);
}

bool Handshake::ready() const { return read_message(dir_ / "ready").has_value(); }

void Handshake::wait_ready(pid_t pid, std::chrono::milliseconds timeout) const {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!ready()) {
    if (!alive(pid)) {
      throw Error(ErrorKind::kHandshake,
                  "the workload (pid " + std::to_string(pid) + ") exited before it said READY",
                  "read its output; it must write `ready` in $GPUSNAP_CONTROL_DIR");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throw Error(
          ErrorKind::kTimeout,
          "the workload did not say READY within " + std::to_string(timeout.count() / 1000) + " s",
          "give it more time (--ready-timeout), or make it write `ready` in "
          "$GPUSNAP_CONTROL_DIR once initialised");
    }
    std::this_thread::sleep_for(kPoll);
  }
}

json Handshake::exchange(pid_t pid, const std::string& request, json body,
                         const std::string& answer, std::chrono::milliseconds timeout) {
  std::string id = fs::random_id().substr(0, 12);
  body["id"] = id;
  body["timeout_ms"] = timeout.count();
  std::error_code ec;
  std::filesystem::remove(dir_ / answer, ec);
  std::filesystem::remove(dir_ / "failed", ec);
  write_message(dir_, request, body);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (auto a = read_message(dir_ / answer); a && text_of(*a, "id") == id) return *a;
    if (auto f = read_message(dir_ / "failed"); f && text_of(*f, "id") == id) {
      std::filesystem::remove(dir_ / request, ec);
      throw Error(ErrorKind::kHandshake,
                  "the workload answered FAILED to " + request + ": " +
                      text_of(*f, "reason", "no reason given"),
                  "see the workload's own log; it was left as it was");
    }
    if (!alive(pid)) {
      throw Error(ErrorKind::kHandshake,
                  "the workload (pid " + std::to_string(pid) + ") exited during " + request,
                  "see the workload's own log");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::filesystem::remove(dir_ / request, ec);
      // It may still be pausing: once it answers PAUSED it would wait for ever.
      if (request == "pause") request_resume_as_source();
      throw Error(ErrorKind::kTimeout,
                  "the workload did not answer " + request + " within " +
                      std::to_string(timeout.count()) + " ms",
                  "give it more time (--handshake-timeout) or check that it polls "
                  "$GPUSNAP_CONTROL_DIR");
    }
    std::this_thread::sleep_for(kPoll);
  }
}

json Handshake::pause(pid_t pid, std::chrono::milliseconds timeout, const json& members) {
  return exchange(pid, "pause", members, "paused", timeout);
}

void Handshake::resume(pid_t pid, const json& context, std::chrono::milliseconds timeout) {
  exchange(pid, "resume", {{"context", context}}, "resumed", timeout);
}

void Handshake::request_resume_as_source() const noexcept { (void)write_resume_as_source(); }

std::string Handshake::write_resume_as_source() const noexcept {
  try {
    // Whoever asked for the pause gave up on it: a workload that has not seen it yet must not
    // pause after answering this resume (it answers a resume at once while running).
    std::error_code ec;
    std::filesystem::remove(dir_ / "pause", ec);
    std::string id = fs::random_id().substr(0, 12);
    write_message(dir_, "resume",
                  {{"id", id},
                   {"context",
                    {{"restored", false},
                     {"copy", 0},
                     {"copies", 1},
                     {"artifact_id", ""},
                     {"gpu_map", json::object()},
                     {"settings", json::object()}}}});
    return id;
  } catch (const std::exception&) {
    // Best effort by contract: the caller is already failing or dying.
    return {};
  }
}

bool Handshake::resume_as_source_and_wait(std::chrono::milliseconds timeout,
                                          const std::vector<pid_t>& workload) const noexcept {
  const std::string id = write_resume_as_source();
  if (id.empty()) return false;
  try {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      for (const char* answer : {"resumed", "failed"}) {
        if (auto a = read_message(dir_ / answer); a && a->value("id", "") == id) return true;
      }
      if (!workload.empty() && std::none_of(workload.begin(), workload.end(), alive)) {
        return false;
      }
      std::this_thread::sleep_for(kPoll);
    }
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): reported as no answer
  }
  return false;
}

void Handshake::clear_exchange() const noexcept {
  std::error_code ec;
  for (const char* name : {"pause", "paused", "resume", "resumed", "failed"}) {
    std::filesystem::remove(dir_ / name, ec);
  }
}

}  // namespace gpusnap::engine
