#include "common/syscall_injection.h"

#include <elf.h>
#include <sys/ptrace.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <thread>

#include "common/fs.h"
#include "gpusnap/error.h"

namespace gpusnap::common {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw Error(ErrorKind::kEnvironment, what,
              "gpusnap stores this memory through CRIU instead; nothing was changed");
}

char thread_state(pid_t pid, pid_t tid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(in, line);
  auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return '?';
  return line[close + 2];
}

// A thread that can be stopped now: the main thread unless it sleeps in the kernel
// uninterruptibly (PTRACE_INTERRUPT would then wait for the kernel), or is gone (a main thread
// may exit before the others).
pid_t pick_thread(pid_t pid) {
  char main_state = thread_state(pid, pid);
  if (main_state == 'S' || main_state == 'R') return pid;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    pid_t tid = std::stoi(entry.path().filename().string());
    char state = thread_state(pid, tid);
    if (state == 'S' || state == 'R') return tid;
  }
  fail("no thread of process " + std::to_string(pid) + " can be stopped now");
}

// Waits for the tracee's next stop. Returns the wait status.
int wait_stop(pid_t tid) {
  int status = 0;
  while (::waitpid(tid, &status, __WALL) < 0) {
    if (errno != EINTR) fail("waitpid(" + std::to_string(tid) + "): " + errno_text(errno));
  }
  if (!WIFSTOPPED(status)) {
    fail("thread " + std::to_string(tid) + " ended while gpusnap held it");
  }
  return status;
}

// Finds the two bytes 0f 05 (`syscall`) in an executable mapping of the target: the vDSO
// first (always present, never written), then the other executable mappings.
uint64_t find_syscall_instruction(pid_t pid) {
  auto maps = read_mappings(pid);
  std::stable_partition(maps.begin(), maps.end(),
                        [](const Mapping& m) { return m.path == "[vdso]"; });
  std::vector<unsigned char> buf;
  for (const auto& m : maps) {
    if (m.perms.size() < 3 || m.perms[2] != 'x' || m.path == "[vsyscall]") continue;
    size_t len = std::min<uint64_t>(m.size(), 1 << 20);
    buf.resize(len);
    iovec local{buf.data(), len};
    // An address in another process: an integer by nature, never dereferenced here.
    iovec remote{reinterpret_cast<void*>(m.start), len};  // NOLINT(performance-no-int-to-ptr)
    ssize_t got = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    for (ssize_t i = 0; i + 1 < got; ++i) {
      if (buf[i] == 0x0f && buf[i + 1] == 0x05) return m.start + i;
    }
  }
  fail("no syscall instruction found in process " + std::to_string(pid));
}

}  // namespace

std::vector<Mapping> read_mappings(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/maps");
  if (!in) {
    throw Error(ErrorKind::kNotFound, "process " + std::to_string(pid) + " does not exist",
                "check the pid");
  }
  std::vector<Mapping> out;
  std::string line;
  while (std::getline(in, line)) {
    // "start-end perms offset dev inode   path"
    std::istringstream fields(line);
    std::string range, dev, inode;
    Mapping m;
    fields >> range >> m.perms >> std::hex >> m.offset >> dev >> inode;
    auto dash = range.find('-');
    if (dash == std::string::npos) continue;
    m.start = std::stoull(range.substr(0, dash), nullptr, 16);
    m.end = std::stoull(range.substr(dash + 1), nullptr, 16);
    std::getline(fields >> std::ws, m.path);
    out.push_back(std::move(m));
  }
  return out;
}

#if defined(__x86_64__)

static_assert(sizeof(user_regs_struct) <= 512);

RemoteThread::RemoteThread(pid_t pid)
    : pid_(pid), tid_(pick_thread(pid)), syscall_insn_(find_syscall_instruction(pid)) {
  if (::ptrace(PTRACE_SEIZE, tid_, nullptr, nullptr) != 0) {
    fail("cannot trace process " + std::to_string(pid) + ": " + errno_text(errno));
  }
  attached_ = true;
  if (::ptrace(PTRACE_INTERRUPT, tid_, nullptr, nullptr) != 0) {
    std::string why = errno_text(errno);
    ::ptrace(PTRACE_DETACH, tid_, nullptr, nullptr);
    attached_ = false;
    fail("cannot stop thread " + std::to_string(tid_) + ": " + why);
  }
  int status = wait_stop(tid_);
  int event = status >> 16;
  int sig = WSTOPSIG(status);
  if (event == PTRACE_EVENT_STOP && sig != SIGTRAP) {
    // A group-stop (SIGSTOP, SIGTSTP, ...): someone else stopped the process on purpose.
    ::ptrace(PTRACE_DETACH, tid_, nullptr, nullptr);
    attached_ = false;
    fail("process " + std::to_string(pid) + " is stopped by a signal");
  }
  // A signal-delivery-stop: the thread had a signal pending; it is delivered on detach.
  if (event == 0) pending_signal_ = sig;
  auto* regs = reinterpret_cast<user_regs_struct*>(saved_regs_);
  if (::ptrace(PTRACE_GETREGS, tid_, nullptr, regs) != 0) {
    std::string why = errno_text(errno);
    restore_and_detach();
    fail("cannot read the registers of thread " + std::to_string(tid_) + ": " + why);
  }
}

RemoteThread::~RemoteThread() { restore_and_detach(); }

void RemoteThread::restore_and_detach() noexcept {
  if (!attached_) return;
  attached_ = false;
  // The saved registers include orig_rax and the -ERESTART* result of a system call the stop
  // interrupted: on the way back to user space the kernel restarts that call as usual.
  ::ptrace(PTRACE_SETREGS, tid_, nullptr, saved_regs_);
  // The signal number travels in ptrace's data argument, as an integer.
  ::ptrace(PTRACE_DETACH, tid_, nullptr,
           reinterpret_cast<void*>(long{pending_signal_}));  // NOLINT(performance-no-int-to-ptr)
}

long RemoteThread::syscall(long nr, uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5,
                           uint64_t a6) {
  user_regs_struct regs{};
  std::memcpy(&regs, saved_regs_, sizeof regs);
  regs.rax = static_cast<uint64_t>(nr);
  regs.rdi = a1;
  regs.rsi = a2;
  regs.rdx = a3;
  regs.r10 = a4;
  regs.r8 = a5;
  regs.r9 = a6;
  regs.rip = syscall_insn_;
  // Not "in a system call": the kernel must not apply restart logic to this one.
  regs.orig_rax = static_cast<uint64_t>(-1);
  if (::ptrace(PTRACE_SETREGS, tid_, nullptr, &regs) != 0) {
    fail("cannot set the registers of thread " + std::to_string(tid_) + ": " + errno_text(errno));
  }
  if (::ptrace(PTRACE_SINGLESTEP, tid_, nullptr, nullptr) != 0) {
    fail("cannot step thread " + std::to_string(tid_) + ": " + errno_text(errno));
  }
  for (;;) {
    int status = wait_stop(tid_);
    if (WSTOPSIG(status) == SIGTRAP && (status >> 16) == 0) break;
    // Another signal arrived first: keep it for the detach, step again.
    if ((status >> 16) == 0) pending_signal_ = WSTOPSIG(status);
    if (::ptrace(PTRACE_SINGLESTEP, tid_, nullptr, nullptr) != 0) {
      fail("cannot step thread " + std::to_string(tid_) + ": " + errno_text(errno));
    }
  }
  user_regs_struct after{};
  if (::ptrace(PTRACE_GETREGS, tid_, nullptr, &after) != 0) {
    fail("cannot read the registers of thread " + std::to_string(tid_) + ": " + errno_text(errno));
  }
  if (after.rip != syscall_insn_ + 2) {
    fail("thread " + std::to_string(tid_) + " did not execute the injected system call");
  }
  return static_cast<long>(after.rax);
}

#else

RemoteThread::RemoteThread(pid_t pid) : pid_(pid), tid_(pid) {
  fail("running a system call in another process is implemented for x86-64 only");
}
RemoteThread::~RemoteThread() = default;
void RemoteThread::restore_and_detach() noexcept {}
long RemoteThread::syscall(long, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t) {
  return -ENOSYS;
}

#endif

void RemoteThread::write_memory(uint64_t address, const void* data, size_t size) {
  iovec local{const_cast<void*>(data), size};
  iovec remote{reinterpret_cast<void*>(address), size};  // NOLINT(performance-no-int-to-ptr)
  ssize_t n = ::process_vm_writev(pid_, &local, 1, &remote, 1, 0);
  if (n != static_cast<ssize_t>(size)) {
    fail("cannot write " + std::to_string(size) + " bytes into process " + std::to_string(pid_) +
         ": " + (n < 0 ? errno_text(errno) : "short write"));
  }
}

}  // namespace gpusnap::common
