#include "gpu/fake_driver.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/uuid.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap::gpu {
namespace {

using namespace gpusnap::testing;  // testing/unit.h
using Calls = std::vector<std::string>;
using namespace std::chrono_literals;

constexpr pid_t kPid = 1234;
constexpr pid_t kOtherPid = 5678;
const std::string kGpuA = "GPU-aaaaaaaa-0000-0000-0000-000000000001";
const std::string kGpuB = "GPU-bbbbbbbb-0000-0000-0000-000000000002";
constexpr uint64_t kGiB = 1ULL << 30;

class FakeDriverTest : public ::testing::Test {
 protected:
  FakeDriverTest() {
    driver.add_gpu(FakeDriver::make_gpu(kGpuA));
    driver.add_gpu(FakeDriver::make_gpu(kGpuB));
    driver.add_process(kPid);
  }
  FakeDriver driver;
};

TEST_F(FakeDriverTest, FullCycleRecordsEveryCallInOrder) {
  EXPECT_EQ(driver.state(kPid), ProcessState::kRunning);
  driver.lock(kPid, 5000ms);
  EXPECT_EQ(driver.state(kPid), ProcessState::kLocked);
  driver.checkpoint(kPid);
  EXPECT_EQ(driver.state(kPid), ProcessState::kCheckpointed);
  driver.restore(kPid, {});
  EXPECT_EQ(driver.state(kPid), ProcessState::kLocked);
  driver.unlock(kPid);
  EXPECT_EQ(driver.state(kPid), ProcessState::kRunning);

  EXPECT_EQ(driver.calls(),
            (Calls{"state 1234", "lock 1234", "state 1234", "checkpoint 1234", "state 1234",
                   "restore 1234", "state 1234", "unlock 1234", "state 1234"}));
  EXPECT_EQ(driver.transitions(),
            (Calls{"lock 1234", "checkpoint 1234", "restore 1234", "unlock 1234"}));
  EXPECT_EQ(driver.last_lock_timeout(), 5000ms);
}

TEST_F(FakeDriverTest, LockedProcessCanBeUnlockedWithoutCheckpoint) {
  driver.lock(kPid, 1000ms);
  driver.unlock(kPid);
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kRunning);
  EXPECT_EQ(driver.calls(), (Calls{"lock 1234", "unlock 1234"}));
}

TEST_F(FakeDriverTest, OutOfOrderCallsThrowIllegalStateAndChangeNothing) {
  // checkpoint before lock
  Error e = catch_error([&] { driver.checkpoint(kPid); });
  EXPECT_EQ(e.kind(), ErrorKind::kGpu);
  EXPECT_EQ(std::string(e.what()),
            "cuCheckpointProcessCheckpoint(pid 1234) failed: CUDA_ERROR_ILLEGAL_STATE: checkpoint "
            "needs a LOCKED process, this one is RUNNING; the process is now RUNNING");
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kRunning);

  // unlock and restore of a RUNNING process
  EXPECT_TRUE(Contains(catch_error([&] { driver.unlock(kPid); }).what(), "ILLEGAL_STATE"));
  EXPECT_TRUE(Contains(catch_error([&] { driver.restore(kPid, {}); }).what(), "ILLEGAL_STATE"));

  // lock twice; restore of a LOCKED (not CHECKPOINTED) process
  driver.lock(kPid, 1000ms);
  EXPECT_TRUE(Contains(catch_error([&] { driver.lock(kPid, 1000ms); }).what(),
                       "lock needs a RUNNING process, this one is LOCKED"));
  EXPECT_TRUE(Contains(catch_error([&] { driver.restore(kPid, {}); }).what(),
                       "restore needs a CHECKPOINTED process, this one is LOCKED"));

  // unlock of a CHECKPOINTED process: it must be restored first
  driver.checkpoint(kPid);
  EXPECT_TRUE(Contains(catch_error([&] { driver.unlock(kPid); }).what(),
                       "unlock needs a LOCKED process, this one is CHECKPOINTED"));
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kCheckpointed);

  // Failed calls are recorded too: the test of gpusnap sees what it asked for.
  EXPECT_EQ(driver.transitions(),
            (Calls{"checkpoint 1234", "unlock 1234", "restore 1234", "lock 1234", "lock 1234",
                   "restore 1234", "checkpoint 1234", "unlock 1234"}));
}

TEST_F(FakeDriverTest, UnknownPidIsNotACudaProcess) {
  Error e = catch_error([&] { driver.state(999); });
  EXPECT_EQ(e.kind(), ErrorKind::kGpu);
  EXPECT_EQ(std::string(e.what()),
            "cuCheckpointProcessGetState(pid 999) failed: CUDA_ERROR_NOT_INITIALIZED: not a CUDA "
            "process");
  EXPECT_THROW(driver.lock(999, 1000ms), Error);
  EXPECT_THROW(driver.peek_state(999), std::out_of_range);
}

TEST_F(FakeDriverTest, RemovedProcessIsGone) {
  driver.remove_process(kPid);
  EXPECT_THROW(driver.state(kPid), Error);
}

TEST_F(FakeDriverTest, CheckpointFailureCanLeaveProcessLocked) {
  driver.fail_next("checkpoint", kPid, ProcessState::kLocked);
  driver.lock(kPid, 1000ms);
  Error e = catch_error([&] { driver.checkpoint(kPid); });
  EXPECT_EQ(e.kind(), ErrorKind::kGpu);
  EXPECT_EQ(std::string(e.what()),
            "cuCheckpointProcessCheckpoint(pid 1234) failed: CUDA_ERROR_UNKNOWN: injected by the "
            "fake driver; the process is now LOCKED");
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kLocked);
  // The fault is spent; the process can be let go, or checkpointed again.
  driver.unlock(kPid);
  driver.lock(kPid, 1000ms);
  driver.checkpoint(kPid);
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kCheckpointed);
}

TEST_F(FakeDriverTest, FailedProcessRefusesEverythingButState) {
  driver.fail_next("checkpoint", kPid, ProcessState::kFailed);
  driver.lock(kPid, 1000ms);
  Error e = catch_error([&] { driver.checkpoint(kPid); });
  EXPECT_TRUE(Contains(e.what(), "the process is now FAILED"));
  EXPECT_TRUE(Contains(e.hint(), "kill"));
  EXPECT_EQ(driver.state(kPid), ProcessState::kFailed);
  EXPECT_THROW(driver.unlock(kPid), Error);
  EXPECT_THROW(driver.lock(kPid, 1000ms), Error);
  EXPECT_THROW(driver.restore(kPid, {}), Error);
  EXPECT_THROW(driver.checkpoint(kPid), Error);
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kFailed);
}

TEST_F(FakeDriverTest, FaultWithoutAfterLeavesStateAlone) {
  driver.fail_next("unlock", kPid);
  driver.lock(kPid, 1000ms);
  EXPECT_THROW(driver.unlock(kPid), Error);
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kLocked);
}

TEST_F(FakeDriverTest, FaultFiresOnTheNthMatchingCallOnly) {
  driver.add_process(kOtherPid);
  driver.fail_next("lock", kPid, std::nullopt, 2);
  driver.lock(kOtherPid, 1000ms);  // another pid: does not count
  driver.lock(kPid, 1000ms);       // first: succeeds
  driver.unlock(kPid);
  EXPECT_THROW(driver.lock(kPid, 1000ms), Error);  // second: fails
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kRunning);
  driver.lock(kPid, 1000ms);  // third: the fault is spent
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kLocked);
}

TEST_F(FakeDriverTest, FaultForAnyPidAndCustomError) {
  FakeDriver::Fault fault;
  fault.call = "restore";
  fault.error = "CUDA_ERROR_NOT_SUPPORTED";
  fault.after = ProcessState::kFailed;
  driver.inject(fault);
  driver.lock(kPid, 1000ms);
  driver.checkpoint(kPid);
  Error e = catch_error([&] { driver.restore(kPid, {}); });
  EXPECT_TRUE(Contains(e.what(), "cuCheckpointProcessRestore(pid 1234) failed: "
                                 "CUDA_ERROR_NOT_SUPPORTED"));
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kFailed);
}

TEST_F(FakeDriverTest, LockTimeoutLeavesProcessRunning) {
  driver.time_out_next_lock(kPid);
  Error e = catch_error([&] { driver.lock(kPid, 250ms); });
  EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
  EXPECT_TRUE(Contains(e.what(), "cuCheckpointProcessLock(pid 1234) failed: the lock timed out"));
  EXPECT_TRUE(Contains(e.what(), "the process stays RUNNING"));
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kRunning);
  EXPECT_EQ(driver.last_lock_timeout(), 250ms);
  driver.lock(kPid, 250ms);  // the next one succeeds
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kLocked);
}

TEST_F(FakeDriverTest, UsageFollowsCheckpointAndRestore) {
  driver.set_usage(kPid, kGpuA, 4 * kGiB);
  driver.set_free_memory(kGpuA, 100 * kGiB);
  ASSERT_EQ(driver.usage().size(), 1u);
  EXPECT_EQ(driver.usage()[0].host_pid, kPid);
  EXPECT_EQ(driver.usage()[0].gpu_uuid, kGpuA);
  EXPECT_EQ(driver.usage()[0].bytes, 4 * kGiB);

  driver.lock(kPid, 1000ms);
  EXPECT_EQ(driver.usage().size(), 1u);  // locked: the memory is still on the GPU
  driver.checkpoint(kPid);
  EXPECT_TRUE(driver.usage().empty());  // checkpointed: released, as nvidia-smi shows
  EXPECT_EQ(driver.facts().gpus[0].memory_free, 104 * kGiB);

  driver.restore(kPid, {});
  EXPECT_EQ(driver.facts().gpus[0].memory_free, 100 * kGiB);
  EXPECT_EQ(driver.usage().size(), 1u);
}

TEST_F(FakeDriverTest, RestoreOntoOtherGpuMovesUsageAndRecordsPairs) {
  driver.set_usage(kPid, kGpuA, 4 * kGiB);
  driver.lock(kPid, 1000ms);
  driver.checkpoint(kPid);
  driver.clear_calls();
  driver.restore(kPid, {{kGpuA, kGpuB}});
  EXPECT_EQ(driver.calls(), (Calls{"restore 1234 " + kGpuA + "->" + kGpuB}));
  const auto usage = driver.usage();
  ASSERT_EQ(usage.size(), 1u);
  EXPECT_EQ(usage[0].gpu_uuid, kGpuB);
  const DriverFacts facts = driver.facts();
  EXPECT_EQ(facts.gpus[0].memory_free, facts.gpus[0].memory_total);
  EXPECT_EQ(facts.gpus[1].memory_free, facts.gpus[1].memory_total - 4 * kGiB);
}

TEST_F(FakeDriverTest, RestoreWithoutEnoughFreeMemoryLeavesProcessFailed) {
  driver.set_usage(kPid, kGpuA, 8 * kGiB);
  driver.lock(kPid, 1000ms);
  driver.checkpoint(kPid);
  driver.set_free_memory(kGpuB, 2 * kGiB);
  Error e = catch_error([&] { driver.restore(kPid, {{kGpuA, kGpuB}}); });
  EXPECT_TRUE(Contains(e.what(), "CUDA_ERROR_OUT_OF_MEMORY"));
  EXPECT_TRUE(Contains(e.what(), "the process is now FAILED"));
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kFailed);
}

TEST_F(FakeDriverTest, RestorePairsMustCoverEveryCheckpointedGpu) {
  driver.set_usage(kPid, kGpuA, kGiB);
  driver.set_usage(kPid, kGpuB, kGiB);
  driver.lock(kPid, 1000ms);
  driver.checkpoint(kPid);
  Error e = catch_error([&] { driver.restore(kPid, {{kGpuA, kGpuB}}); });
  EXPECT_TRUE(Contains(e.what(), "CUDA_ERROR_INVALID_VALUE"));
  EXPECT_TRUE(Contains(e.what(), kGpuB + " is missing"));
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kCheckpointed);
  // Swapping the two GPUs is fine.
  driver.restore(kPid, {{kGpuA, kGpuB}, {kGpuB, kGpuA}});
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kLocked);
}

TEST_F(FakeDriverTest, RestoreOntoUnknownGpuFails) {
  driver.lock(kPid, 1000ms);
  driver.checkpoint(kPid);
  const std::string elsewhere = "GPU-cccccccc-0000-0000-0000-000000000003";
  Error e = catch_error([&] { driver.restore(kPid, {{kGpuA, elsewhere}}); });
  EXPECT_TRUE(Contains(e.what(), "no GPU " + elsewhere));
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kCheckpointed);
}

TEST_F(FakeDriverTest, RestoreWithMalformedUuidIsAUsageError) {
  driver.lock(kPid, 1000ms);
  driver.checkpoint(kPid);
  Error e = catch_error([&] { driver.restore(kPid, {{"GPU-a", kGpuB}}); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_TRUE(Contains(e.what(), "malformed GPU UUID 'GPU-a'"));
  EXPECT_EQ(driver.peek_state(kPid), ProcessState::kCheckpointed);
}

TEST_F(FakeDriverTest, FactsListGpusWithIndices) {
  const DriverFacts facts = driver.facts();
  EXPECT_EQ(facts.driver_version, "580.159.04");
  EXPECT_EQ(facts.cuda_driver_version, 13000);
  ASSERT_EQ(facts.gpus.size(), 2u);
  EXPECT_EQ(facts.gpus[0].index, 0);
  EXPECT_EQ(facts.gpus[0].uuid, kGpuA);
  EXPECT_EQ(facts.gpus[1].index, 1);
  EXPECT_EQ(facts.gpus[1].name, "NVIDIA H200");
}

TEST_F(FakeDriverTest, FactsAndUsageCanFail) {
  driver.fail_next("facts", 0);
  driver.fail_next("usage", 0);
  EXPECT_EQ(catch_error([&] { driver.facts(); }).kind(), ErrorKind::kGpu);
  EXPECT_EQ(catch_error([&] { driver.usage(); }).kind(), ErrorKind::kGpu);
  EXPECT_NO_THROW(driver.facts());
  EXPECT_EQ(driver.calls(), (Calls{"facts", "usage", "facts"}));
}

TEST_F(FakeDriverTest, UnavailableDriverThrowsEnvironment) {
  driver.set_unavailable("libcuda.so.1 not found");
  EXPECT_FALSE(driver.available());
  EXPECT_EQ(driver.reason(), "libcuda.so.1 not found");
  Error e = catch_error([&] { driver.lock(kPid, 1000ms); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_TRUE(Contains(e.what(), "no NVIDIA driver on this host"));
  EXPECT_THROW(driver.facts(), Error);
  EXPECT_TRUE(driver.calls().empty());
}

TEST(ProcessStateTest, Names) {
  EXPECT_STREQ(state_name(ProcessState::kRunning), "RUNNING");
  EXPECT_STREQ(state_name(ProcessState::kLocked), "LOCKED");
  EXPECT_STREQ(state_name(ProcessState::kCheckpointed), "CHECKPOINTED");
  EXPECT_STREQ(state_name(ProcessState::kFailed), "FAILED");
}

// The real driver, as found on the machine the tests run on.
TEST(NvidiaDriverTest, WithoutDriverIsUnavailableAndThrowsEnvironment) {
  auto driver = open_nvidia_driver();
  ASSERT_NE(driver, nullptr);
  if (driver->available()) GTEST_SKIP() << "this host has an NVIDIA driver";
  EXPECT_TRUE(Contains(driver->reason(), "libcuda"));
  EXPECT_EQ(driver->reason().find('\n'), std::string::npos);  // one line
  Error e = catch_error([&] { driver->facts(); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_TRUE(Contains(e.what(), "no NVIDIA driver on this host"));
  EXPECT_FALSE(e.hint().empty());
  EXPECT_EQ(catch_error([&] { driver->lock(1, 1000ms); }).kind(), ErrorKind::kEnvironment);
  EXPECT_EQ(catch_error([&] { driver->usage(); }).kind(), ErrorKind::kEnvironment);
}

TEST(NvidiaDriverTest, WithDriverReportsGpus) {
  auto driver = open_nvidia_driver();
  if (!driver->available()) GTEST_SKIP() << driver->reason();
  const DriverFacts facts = driver->facts();
  EXPECT_FALSE(facts.driver_version.empty());
  EXPECT_GT(facts.cuda_driver_version, 0);
  ASSERT_FALSE(facts.gpus.empty());
  for (const GpuInfo& gpu : facts.gpus) {
    EXPECT_TRUE(parse_gpu_uuid(gpu.uuid).has_value()) << gpu.uuid;
    EXPECT_FALSE(gpu.name.empty());
    EXPECT_FALSE(gpu.bus_id.empty());
    EXPECT_GT(gpu.memory_total, 0u);
    EXPECT_LE(gpu.memory_free, gpu.memory_total);
  }
  EXPECT_NO_THROW(driver->usage());

  // A process that never initialised CUDA is not a CUDA process to the driver: an error, not a
  // state. (This test process itself counts as one once facts() has called cuInit.)
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    pause();
    _exit(0);
  }
  Error e = catch_error([&] { driver->state(child); });
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_EQ(e.kind(), ErrorKind::kGpu);
  EXPECT_TRUE(Contains(e.what(), "cuCheckpointProcessGetState(pid " + std::to_string(child) +
                                     ") failed: CUDA_ERROR_"));
  EXPECT_FALSE(e.hint().empty());
}

}  // namespace
}  // namespace gpusnap::gpu
