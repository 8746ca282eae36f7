// The C++ handshake client (clients/include/gpusnap/handshake_client.h) against a temporary control
// directory, with this test playing gpusnap's side by writing and reading the files.
#include "gpusnap/handshake_client.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
namespace hs = gpusnap::handshake;

// The client is versioned as gpusnap is (GPUSNAP_VERSION: the CMake project version).
static_assert(std::string_view(GPUSNAP_CLIENT_VERSION) == GPUSNAP_VERSION,
              "set GPUSNAP_CLIENT_VERSION in clients/include/gpusnap/handshake_client.h to the "
              "project version in CMakeLists.txt");
using hs::detail::Json;

namespace {

using namespace std::chrono_literals;

// The tests change the environment only while no client thread runs.
void set_control_dir(const char* value) {
  ::setenv("GPUSNAP_CONTROL_DIR", value, 1);  // NOLINT(concurrency-mt-unsafe): see above
}
void unset_control_dir() {
  ::unsetenv("GPUSNAP_CONTROL_DIR");  // NOLINT(concurrency-mt-unsafe): see above
}

class HandshakeClient : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "gpusnap-handshake-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
    dir_ = root_ / "control";
    fs::create_directory(dir_);
    set_control_dir(dir_.c_str());
  }
  void TearDown() override {
    unset_control_dir();
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // gpusnap's side: an atomic write, as the protocol asks.
  void put(const std::string& name, const std::string& body) {
    const fs::path tmp = dir_ / (name + ".tmp");
    {
      std::ofstream f(tmp);
      f << body;
    }
    fs::rename(tmp, dir_ / name);
  }
  std::optional<std::string> get(const std::string& name) const {
    std::ifstream f(dir_ / name);
    if (!f) return std::nullopt;
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  std::optional<Json> get_json(const std::string& name) const {
    const auto text = get(name);
    if (!text) return std::nullopt;
    return hs::detail::parse_json(*text);
  }
  // Waits (up to 3 s) for NAME to hold a JSON object whose "id" is `id` (no "id" if empty).
  std::optional<Json> wait_answer(const std::string& name, const std::string& id) const {
    const auto deadline = std::chrono::steady_clock::now() + 3s;
    while (std::chrono::steady_clock::now() < deadline) {
      if (auto j = get_json(name)) {
        const Json* v = j->find("id");
        if ((v != nullptr && v->text == id) || (v == nullptr && id.empty())) return j;
      }
      std::this_thread::sleep_for(5ms);
    }
    return std::nullopt;
  }
  void remove(const std::string& name) { fs::remove(dir_ / name); }
  static std::string field(const Json& j, const char* key) {
    const Json* v = j.find(key);
    return v != nullptr ? v->text : "<absent>";
  }
  bool no_tmp_files() const {
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().extension() == ".tmp") return false;
    }
    return true;
  }

  fs::path root_;
  fs::path dir_;
};

// Counts callbacks and records the last resume context.
struct Recorder {
  std::atomic<int> pauses{0};
  std::atomic<int> resumes{0};
  std::mutex mu;
  hs::ResumeContext last;
  std::atomic<bool> pause_ok{true};
  std::atomic<bool> resume_ok{true};
  std::string reason = "nope";

  void serve(hs::Client& c) {
    c.serve(
        [this](std::string& r) {
          ++pauses;
          const bool ok = pause_ok;
          if (!ok) r = reason;
          return ok;
        },
        [this](const hs::ResumeContext& ctx, std::string& r) {
          {
            std::lock_guard<std::mutex> l(mu);
            last = ctx;
          }
          ++resumes;
          const bool ok = resume_ok;
          if (!ok) r = reason;
          return ok;
        });
  }
};

constexpr const char* kFullContext =
    R"({"id":"r1","context":{"restored":true,"copy":2,"copies":4,"artifact_id":"art-7",)"
    R"("gpu_map":{"GPU-aaa":"GPU-bbb"},"settings":{"greeting":"hi \"there\"","port":"8001"}}})";

TEST_F(HandshakeClient, NoControlDirIsNoop) {
  unset_control_dir();
  auto c = hs::Client::from_environment();
  EXPECT_FALSE(c.enabled());
  EXPECT_EQ(c.control_dir(), "");
  c.ready();
  Recorder rec;
  rec.serve(c);
  EXPECT_EQ(c.poll(), std::nullopt);
  c.answer_paused("x");
  c.answer_resumed("x");
  c.answer_failed("x", "y");
  c.stop();
  EXPECT_TRUE(fs::is_empty(dir_));

  set_control_dir("");
  EXPECT_FALSE(hs::Client::from_environment().enabled());
  set_control_dir("relative/dir");
  EXPECT_FALSE(hs::Client::from_environment().enabled());
}

TEST_F(HandshakeClient, ReadyHasProtocolAndPid) {
  auto c = hs::Client::from_environment();
  ASSERT_TRUE(c.enabled());
  EXPECT_EQ(c.control_dir(), dir_.string());
  c.ready();
  const auto j = get_json("ready");
  ASSERT_TRUE(j);
  long long protocol = 0, pid = 0;
  ASSERT_TRUE(j->find("protocol") && hs::detail::as_int(*j->find("protocol"), protocol));
  ASSERT_TRUE(j->find("pid") && hs::detail::as_int(*j->find("pid"), pid));
  EXPECT_EQ(protocol, 1);
  EXPECT_EQ(pid, ::getpid());
  EXPECT_TRUE(no_tmp_files());
}

TEST_F(HandshakeClient, ReadyIsWrittenOnceTheDirectoryIsThere) {
  fs::remove_all(dir_);
  auto c = hs::Client::from_environment();
  c.ready();  // the directory is missing: retried by the serving thread
  Recorder rec;
  rec.serve(c);
  std::this_thread::sleep_for(100ms);
  fs::create_directory(dir_);
  EXPECT_TRUE(wait_answer("ready", "")) << "no ready";
}

TEST_F(HandshakeClient, PauseIsAnsweredPausedWithTheSameId) {
  auto c = hs::Client::from_environment();
  c.ready();
  Recorder rec;
  rec.serve(c);
  put("pause", R"({"id":"cap-1","timeout_ms":5000})");
  ASSERT_TRUE(wait_answer("paused", "cap-1"));
  EXPECT_EQ(rec.pauses, 1);
  EXPECT_TRUE(no_tmp_files());
}

// The memory tier's drain takes the GPU memory away: a pause waits for the GPU work in flight,
// holds new work back until the resume, and fails, saying so, when the work does not end.
TEST_F(HandshakeClient, APauseWaitsForGpuWorkAndHoldsItBackUntilTheResume) {
  auto c = hs::Client::from_environment();
  Recorder rec;
  rec.serve(c);
  std::atomic<bool> release{false}, started{false}, late_done{false};
  std::thread in_flight([&] {
    auto work = c.gpu_work();
    started = true;
    while (!release) std::this_thread::sleep_for(5ms);
  });
  while (!started) std::this_thread::sleep_for(5ms);
  put("pause", R"({"id":"p1","timeout_ms":20000})");
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(rec.pauses, 0) << "on_pause ran with GPU work in flight";
  release = true;
  in_flight.join();
  ASSERT_TRUE(wait_answer("paused", "p1"));
  std::thread late([&] {
    auto work = c.gpu_work();
    late_done = true;
  });
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(late_done) << "GPU work ran during the pause";
  put("resume", R"({"id":"r1","context":{"restored":false}})");
  ASSERT_TRUE(wait_answer("resumed", "r1"));
  late.join();
  EXPECT_TRUE(late_done);
}

TEST_F(HandshakeClient, GpuWorkThatDoesNotEndFailsThePauseAndServingGoesOn) {
  auto c = hs::Client::from_environment();
  Recorder rec;
  rec.serve(c);
  std::atomic<bool> release{false}, started{false};
  std::thread stuck([&] {
    auto work = c.gpu_work();
    started = true;
    while (!release) std::this_thread::sleep_for(5ms);
  });
  while (!started) std::this_thread::sleep_for(5ms);
  put("pause", R"({"id":"p1","timeout_ms":1000})");
  const auto j = wait_answer("failed", "p1");
  ASSERT_TRUE(j);
  EXPECT_NE(field(*j, "reason").find("did not end within 0.5 s of the pause"), std::string::npos)
      << field(*j, "reason");
  EXPECT_EQ(rec.pauses, 0);
  { auto again = c.gpu_work(); }  // open again: this returns at once
  release = true;
  stuck.join();
}

TEST_F(HandshakeClient, APauseWithAnAnsweredIdIsIgnored) {
  auto c = hs::Client::from_environment();
  Recorder rec;
  rec.serve(c);
  put("pause", R"({"id":"p1","timeout_ms":5000})");
  ASSERT_TRUE(wait_answer("paused", "p1"));
  remove("pause");
  remove("paused");
  put("resume", R"({"id":"r1","context":{"restored":false,"copy":0,"copies":1}})");
  ASSERT_TRUE(wait_answer("resumed", "r1"));
  remove("resume");
  remove("resumed");

  // The same pause again (a stale file): never answered twice.
  put("pause", R"({"id":"p1","timeout_ms":5000})");
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(get("paused"));
  EXPECT_EQ(rec.pauses, 1);

  // A new id is a new request.
  put("pause", R"({"id":"p2","timeout_ms":5000})");
  ASSERT_TRUE(wait_answer("paused", "p2"));
  EXPECT_EQ(rec.pauses, 2);
}

TEST_F(HandshakeClient, FailedWithReasonWhenOnPauseReturnsFalse) {
  auto c = hs::Client::from_environment();
  Recorder rec;
  rec.pause_ok = false;
  rec.reason = "busy: \"batch\" in flight\n\\ok";
  rec.serve(c);
  put("pause", R"({"id":"p1","timeout_ms":100})");
  const auto j = wait_answer("failed", "p1");
  ASSERT_TRUE(j);
  EXPECT_EQ(field(*j, "reason"), rec.reason);
  EXPECT_FALSE(get("paused"));

  // A failed pause leaves the workload running: the next pause is handled again.
  rec.pause_ok = true;
  put("pause", R"({"id":"p2","timeout_ms":100})");
  ASSERT_TRUE(wait_answer("paused", "p2"));
  EXPECT_EQ(rec.pauses, 2);
}

TEST_F(HandshakeClient, AnExceptionInACallbackIsAFailure) {
  auto c = hs::Client::from_environment();
  c.serve([](std::string&) -> bool { throw std::runtime_error("cannot release"); },
          [](const hs::ResumeContext&, std::string&) { return true; });
  put("pause", R"({"id":"p1"})");
  const auto j = wait_answer("failed", "p1");
  ASSERT_TRUE(j);
  EXPECT_EQ(field(*j, "reason"), "cannot release");
}

TEST_F(HandshakeClient, ResumeContextIsParsedAndAnswered) {
  auto c = hs::Client::from_environment();
  c.ready();
  Recorder rec;
  rec.serve(c);
  put("pause", R"({"id":"p1","timeout_ms":5000})");
  ASSERT_TRUE(wait_answer("paused", "p1"));
  remove("ready");  // to see it written again
  put("resume", kFullContext);
  ASSERT_TRUE(wait_answer("resumed", "r1"));
  EXPECT_TRUE(get("ready"));  // capturable again
  std::lock_guard<std::mutex> l(rec.mu);
  EXPECT_EQ(rec.resumes, 1);
  EXPECT_TRUE(rec.last.restored);
  EXPECT_EQ(rec.last.copy, 2);
  EXPECT_EQ(rec.last.copies, 4);
  EXPECT_EQ(rec.last.artifact_id, "art-7");
  EXPECT_EQ(rec.last.gpu_map, (std::map<std::string, std::string>{{"GPU-aaa", "GPU-bbb"}}));
  EXPECT_EQ(rec.last.settings,
            (std::map<std::string, std::string>{{"greeting", "hi \"there\""}, {"port", "8001"}}));
}

TEST_F(HandshakeClient, AFailedResumeStaysPausedAndMayBeRetried) {
  auto c = hs::Client::from_environment();
  Recorder rec;
  rec.resume_ok = false;
  rec.reason = "no memory";
  rec.serve(c);
  put("pause", R"({"id":"p1"})");
  ASSERT_TRUE(wait_answer("paused", "p1"));
  put("resume", R"({"id":"r1","context":{"restored":false}})");
  const auto j = wait_answer("failed", "r1");
  ASSERT_TRUE(j);
  EXPECT_EQ(field(*j, "reason"), "no memory");
  rec.resume_ok = true;
  put("resume", R"({"id":"r2","context":{"restored":false}})");
  ASSERT_TRUE(wait_answer("resumed", "r2"));
  EXPECT_EQ(rec.resumes, 2);
  EXPECT_EQ(rec.pauses, 1);
}

TEST_F(HandshakeClient, ControlDirRemovedAndRecreatedMidWait) {
  auto c = hs::Client::from_environment();
  c.ready();
  Recorder rec;
  rec.serve(c);
  // Gone while the workload waits for a pause: it keeps polling.
  fs::remove_all(dir_);
  std::this_thread::sleep_for(150ms);
  fs::create_directory(dir_);
  put("pause", R"({"id":"p1","timeout_ms":5000})");
  ASSERT_TRUE(wait_answer("paused", "p1"));

  // A restore: the paused workload finds a fresh directory at the same path, here with a stale
  // copy of the pause it already answered, which must not be answered again.
  fs::remove_all(dir_);
  std::this_thread::sleep_for(150ms);
  fs::create_directory(dir_);
  put("pause", R"({"id":"p1","timeout_ms":5000})");
  put("resume", kFullContext);
  ASSERT_TRUE(wait_answer("resumed", "r1"));
  EXPECT_FALSE(get("paused"));
  EXPECT_TRUE(get("ready"));
  EXPECT_EQ(rec.pauses, 1);
  EXPECT_EQ(rec.resumes, 1);
}

TEST_F(HandshakeClient, PollStyle) {
  auto c = hs::Client::from_environment();
  c.ready();
  EXPECT_EQ(c.poll(), std::nullopt);
  put("pause", R"({"id":"p1","timeout_ms":1234})");
  auto req = c.poll();
  ASSERT_TRUE(req);
  EXPECT_EQ(req->kind, hs::Request::Kind::kPause);
  EXPECT_EQ(req->id, "p1");
  EXPECT_EQ(req->timeout_ms, 1234);
  ASSERT_TRUE(c.poll());  // handed out again until answered
  c.answer_paused("p1");
  ASSERT_TRUE(wait_answer("paused", "p1"));
  EXPECT_EQ(c.poll(), std::nullopt);  // the pause file is still there: already answered

  put("resume", kFullContext);
  req = c.poll();
  ASSERT_TRUE(req);
  EXPECT_EQ(req->kind, hs::Request::Kind::kResume);
  EXPECT_EQ(req->id, "r1");
  EXPECT_EQ(req->context.copy, 2);
  EXPECT_EQ(req->context.settings.at("port"), "8001");
  c.answer_resumed("r1");
  ASSERT_TRUE(wait_answer("resumed", "r1"));
  EXPECT_EQ(c.poll(), std::nullopt);

  put("pause", R"({"id":"p2"})");
  req = c.poll();
  ASSERT_TRUE(req);
  c.answer_failed("p2", "not now");
  const auto j = wait_answer("failed", "p2");
  ASSERT_TRUE(j);
  EXPECT_EQ(field(*j, "reason"), "not now");
  EXPECT_EQ(c.poll(), std::nullopt);
}

TEST_F(HandshakeClient, AResumeThatFindsTheWorkloadRunningIsAnsweredAtOnce) {
  auto c = hs::Client::from_environment();
  put("resume", R"({"id":"r9","context":{"restored":false}})");
  EXPECT_EQ(c.poll(), std::nullopt);
  EXPECT_TRUE(wait_answer("resumed", "r9"));
}

TEST_F(HandshakeClient, MalformedRequests) {
  auto c = hs::Client::from_environment();
  // Not JSON, or no id: cannot be answered, ignored.
  put("pause", "{\"id\":\"p1\"");
  EXPECT_EQ(c.poll(), std::nullopt);
  put("pause", R"({"timeout_ms":5})");
  EXPECT_EQ(c.poll(), std::nullopt);
  EXPECT_FALSE(get("failed"));
  // An id but a bad field: answered failed.
  put("pause", R"({"id":"p2","timeout_ms":"soon"})");
  EXPECT_EQ(c.poll(), std::nullopt);
  auto j = wait_answer("failed", "p2");
  ASSERT_TRUE(j);
  EXPECT_EQ(field(*j, "reason").rfind("bad request: ", 0), 0u) << field(*j, "reason");

  remove("pause");
  put("pause", R"({"id":"p3"})");
  ASSERT_TRUE(c.poll());
  c.answer_paused("p3");
  put("resume", R"({"id":"r1","context":{"settings":{"n":1}}})");
  EXPECT_EQ(c.poll(), std::nullopt);
  j = wait_answer("failed", "r1");
  ASSERT_TRUE(j);
  EXPECT_NE(field(*j, "reason").find("settings"), std::string::npos) << field(*j, "reason");
  put("resume", R"({"id":"r2"})");
  EXPECT_EQ(c.poll(), std::nullopt);
  EXPECT_TRUE(wait_answer("failed", "r2"));
  // Still paused: a good resume is handed out.
  put("resume", R"({"id":"r3","context":{},"extra":[1,{"x":null}]})");
  const auto req = c.poll();
  ASSERT_TRUE(req);
  EXPECT_FALSE(req->context.restored);
  EXPECT_EQ(req->context.copies, 1);
}

TEST_F(HandshakeClient, ServeTwiceOrPollWhileServingIsAnError) {
  auto c = hs::Client::from_environment();
  Recorder rec;
  rec.serve(c);
  EXPECT_THROW(rec.serve(c), std::logic_error);
  EXPECT_THROW(c.poll(), std::logic_error);
}

TEST_F(HandshakeClient, AMovedClientKeepsServing) {
  auto a = hs::Client::from_environment();
  Recorder rec;
  rec.serve(a);
  hs::Client b = std::move(a);
  // NOLINTNEXTLINE(bugprone-use-after-move,clang-analyzer-cplusplus.Move): inert once moved
  EXPECT_FALSE(a.enabled());
  put("pause", R"({"id":"p1"})");
  ASSERT_TRUE(wait_answer("paused", "p1"));
  b.stop();
  put("resume", R"({"id":"r1","context":{}})");
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(get("resumed"));  // stopped
}

TEST_F(HandshakeClient, StopFromInsideACallback) {
  auto c = hs::Client::from_environment();
  std::atomic<int> calls{0};
  c.serve(
      [&](std::string&) {
        ++calls;
        c.stop();
        return true;
      },
      [](const hs::ResumeContext&, std::string&) { return true; });
  put("pause", R"({"id":"p1"})");
  ASSERT_TRUE(wait_answer("paused", "p1"));
  put("resume", R"({"id":"r1","context":{}})");
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(get("resumed"));
  EXPECT_EQ(calls, 1);
}

// ---- The memory tier: the client drains after on_pause and fills before on_resume ----------

// Stands in for the GPU side of libgpusnap-tier.so: records what the client asks, in order with
// the workload's callbacks, and fails when told to.
struct RecordingTier {
  std::mutex mu;
  std::vector<std::string> log;
  std::string drain_error, fill_error, adopt_error;
  bool drained = false;

  void note(std::string line) {
    std::lock_guard lock(mu);
    log.push_back(std::move(line));
  }
  std::vector<std::string> lines() {
    std::lock_guard lock(mu);
    return log;
  }
  hs::MemoryTier bind() {
    hs::MemoryTier t;
    t.drain = [this](const std::string& dir, std::string& error) {
      note("drain " + dir);
      if (!drain_error.empty()) {
        error = drain_error;
        return false;
      }
      drained = true;
      return true;
    };
    t.fill = [this](const std::string& dir, const std::map<std::string, std::string>& map,
                    std::string& error) {
      std::string pairs;
      for (const auto& [a, b] : map) pairs += " " + a + "=" + b;
      note("fill " + dir + pairs);
      if (!fill_error.empty()) {
        error = fill_error;
        return false;
      }
      drained = false;
      return true;
    };
    t.drained = [this] { return drained; };
    t.adopt = [this](const std::string& dir, std::string& error) {
      note("adopt " + dir);
      error = adopt_error;
      return adopt_error.empty();
    };
    return t;
  }
  void serve(hs::Client& c) {
    c.use_memory_tier(bind());
    c.serve(
        [this](std::string&) {
          note("on_pause");
          return true;
        },
        [this](const hs::ResumeContext& ctx, std::string&) {
          note("on_resume " + std::string(ctx.restored ? "restored " : "source ") + ctx.tier_dir);
          return true;
        });
  }
};

TEST_F(HandshakeClient, TheTierDrainsAfterOnPauseAndFillsBeforeOnResume) {
  auto c = hs::Client::from_environment();
  RecordingTier tier;
  tier.serve(c);
  put("pause", R"({"id":"p1","timeout_ms":5000,"tier_dir":"/staging/tier"})");
  ASSERT_TRUE(wait_answer("paused", "p1"));
  put("resume",
      R"({"id":"r1","context":{"restored":true,"gpu_map":{"GPU-a":"GPU-b"},"tier_dir":"/art/tier"}})");
  ASSERT_TRUE(wait_answer("resumed", "r1"));
  EXPECT_EQ(tier.lines(), (std::vector<std::string>{"on_pause", "drain /staging/tier",
                                                    "fill /art/tier GPU-a=GPU-b",
                                                    "on_resume restored /art/tier"}));
}

// A copy whose tier a prefill filled ahead takes that memory over before the fill, which then
// copies what is left; a failed takeover is no failed resume: the fill copies everything.
TEST_F(HandshakeClient, APrefillsMemoryIsTakenOverBeforeTheFillAndItsFailureIsNoFailure) {
  auto c = hs::Client::from_environment();
  RecordingTier tier;
  tier.adopt_error = "memory tier: the prefill's memory is on device 1";
  tier.serve(c);
  for (const char* id : {"1", "2"}) {
    put("pause", std::string(R"({"id":"p)") + id + R"(","tier_dir":"/t"})");
    ASSERT_TRUE(wait_answer("paused", std::string("p") + id));
    put("resume", std::string(R"({"id":"r)") + id +
                      R"(","context":{"restored":true,"tier_dir":"/a","tier_prefill_dir":"/p"}})");
    ASSERT_TRUE(wait_answer("resumed", std::string("r") + id));
    tier.adopt_error.clear();
  }
  EXPECT_EQ(tier.lines(),
            (std::vector<std::string>{"on_pause", "drain /t", "adopt /p", "fill /a",
                                      "on_resume restored /a", "on_pause", "drain /t", "adopt /p",
                                      "fill /a", "on_resume restored /a"}));
}

TEST_F(HandshakeClient, APauseWithoutTierDirDrainsNothing) {
  auto c = hs::Client::from_environment();
  RecordingTier tier;
  tier.serve(c);
  put("pause", R"({"id":"p1"})");
  ASSERT_TRUE(wait_answer("paused", "p1"));
  put("resume", R"({"id":"r1","context":{"restored":false}})");
  ASSERT_TRUE(wait_answer("resumed", "r1"));
  EXPECT_EQ(tier.lines(), (std::vector<std::string>{"on_pause", "on_resume source "}));
}

TEST_F(HandshakeClient, AFailedDrainUndoesOnPauseAndAnswersFailed) {
  auto c = hs::Client::from_environment();
  RecordingTier tier;
  tier.drain_error = "memory tier: cannot write /x/1-w0.img: No space left on device";
  tier.serve(c);
  put("pause", R"({"id":"p1","tier_dir":"/x"})");
  const auto failed = wait_answer("failed", "p1");
  ASSERT_TRUE(failed);
  EXPECT_EQ(failed->find("reason")->text, tier.drain_error);
  EXPECT_EQ(tier.lines(), (std::vector<std::string>{"on_pause", "drain /x", "on_resume source "}));
  EXPECT_FALSE(get("paused"));
}

TEST_F(HandshakeClient, AFailedFillStaysPausedAndANewResumeRetries) {
  auto c = hs::Client::from_environment();
  RecordingTier tier;
  tier.fill_error = "memory tier: out of GPU memory";
  tier.serve(c);
  put("pause", R"({"id":"p1","tier_dir":"/t"})");
  ASSERT_TRUE(wait_answer("paused", "p1"));
  put("resume", R"({"id":"r1","context":{"restored":true,"tier_dir":"/a"}})");
  const auto failed = wait_answer("failed", "r1");
  ASSERT_TRUE(failed);
  EXPECT_EQ(failed->find("reason")->text, "memory tier: out of GPU memory");
  tier.fill_error.clear();
  put("resume", R"({"id":"r2","context":{"restored":true,"tier_dir":"/a"}})");
  ASSERT_TRUE(wait_answer("resumed", "r2"));
  EXPECT_EQ(tier.lines(), (std::vector<std::string>{"on_pause", "drain /t", "fill /a", "fill /a",
                                                    "on_resume restored /a"}));
}

TEST_F(HandshakeClient, ATierDirOfTheWrongTypeIsABadRequest) {
  auto c = hs::Client::from_environment();
  RecordingTier tier;
  tier.serve(c);
  put("pause", R"({"id":"p1","tier_dir":7})");
  const auto failed = wait_answer("failed", "p1");
  ASSERT_TRUE(failed);
  EXPECT_EQ(failed->find("reason")->text, "bad request: tier_dir is not a string");
  EXPECT_TRUE(tier.lines().empty());
}

TEST(HandshakeMemoryTier, OfLibraryBindsTheBuiltLibrary) {
  EXPECT_FALSE(hs::MemoryTier::of_library("/nonexistent/libgpusnap-tier.so"));
  auto tier = hs::MemoryTier::of_library(GPUSNAP_TIER_LIBRARY);
  ASSERT_TRUE(tier);
  EXPECT_FALSE(tier->drained());  // nothing allocated
  std::string error;
  EXPECT_FALSE(tier->drain("", error));
  EXPECT_EQ(error, "memory tier: no folder to drain into");
  // Now in the process, it is found without a path, as a linked library would be.
  EXPECT_TRUE(hs::MemoryTier::of_library());
}

TEST(HandshakeJson, ParsesWhatGpusnapWrites) {
  auto j = hs::detail::parse_json(
      " {\"a\" : \"x\\u00e9\\ud83d\\ude00\\n\\/\" , \"b\":[true,false,null,-1.5e3],\"c\":{}} ");
  ASSERT_TRUE(j);
  EXPECT_EQ(j->find("a")->text, "x\xc3\xa9\xf0\x9f\x98\x80\n/");
  EXPECT_EQ(j->find("b")->items.size(), 4u);
  EXPECT_EQ(j->find("c")->type, Json::Type::kObject);
  long long n = 0;
  EXPECT_FALSE(hs::detail::as_int(j->find("b")->items[3], n));
  EXPECT_TRUE(hs::detail::as_int(*hs::detail::parse_json("-42"), n));
  EXPECT_EQ(n, -42);
  EXPECT_FALSE(hs::detail::as_int(*hs::detail::parse_json("99999999999999999999"), n));
  // Duplicate keys: the last wins.
  EXPECT_EQ(hs::detail::parse_json(R"({"id":"a","id":"b"})")->find("id")->text, "b");
}

TEST(HandshakeJson, RejectsWhatIsNotJson) {
  for (const char* bad : {"", "{", "{\"a\":1,}", "{\"a\" 1}", "[1 2]", "01", "1.", "-", "\"\\x\"",
                          "\"\\ud800\"", "\"a\nb\"", "{} {}", "tru", "{'a':1}"}) {
    EXPECT_FALSE(hs::detail::parse_json(bad)) << bad;
  }
  EXPECT_FALSE(hs::detail::parse_json(std::string(100, '[') + std::string(100, ']')));
}

TEST(HandshakeJson, QuoteRoundTripsAndCleansInvalidUtf8) {
  const std::string s = "a\"b\\c\n\t\x01 \xc3\xa9";
  EXPECT_EQ(hs::detail::parse_json(hs::detail::quote(s))->text, s);
  EXPECT_EQ(hs::detail::quote("x\xff\xc3"), "\"x??\"");
  EXPECT_EQ(hs::detail::shorten(std::string(5000, 'r')).size(), hs::detail::kMaxReasonBytes + 3);
}

}  // namespace
