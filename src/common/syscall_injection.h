// Running a system call inside another process, the way CRIU's parasite engine does for its
// own set-up: one thread of the target is stopped with ptrace, made to execute a `syscall`
// instruction that already exists in its address space (the vDSO's, or libc's), and put back
// exactly as it was. gpusnap uses it to change a mapping of a process whose CUDA state is
// checkpointed (see engine/host_images.h); nothing else in the target moves.
//
// x86-64 only: elsewhere the constructor throws Error(kEnvironment) and callers take the path
// that needs no injection.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gpusnap::common {

class RemoteThread {
 public:
  // Stops one thread of `pid` (its main thread unless it sleeps uninterruptibly) with
  // PTRACE_SEIZE + PTRACE_INTERRUPT. Throws Error(kEnvironment) when it cannot: another tracer,
  // a group-stopped process, no syscall instruction found, another architecture.
  explicit RemoteThread(pid_t pid);
  RemoteThread(const RemoteThread&) = delete;
  RemoteThread& operator=(const RemoteThread&) = delete;
  // Restores the thread's registers and detaches, re-delivering a signal it was stopped with.
  ~RemoteThread();

  // Executes syscall `nr` with up to six arguments in the target. Returns the raw result
  // (a negative errno on failure, as the kernel returns it). Throws only when ptrace fails.
  long syscall(long nr, uint64_t a1 = 0, uint64_t a2 = 0, uint64_t a3 = 0, uint64_t a4 = 0,
               uint64_t a5 = 0, uint64_t a6 = 0);

  // Copies bytes into the target's memory. Throws Error(kEnvironment) on a short write.
  void write_memory(uint64_t address, const void* data, size_t size);

  pid_t tid() const { return tid_; }

 private:
  void restore_and_detach() noexcept;

  pid_t pid_;
  pid_t tid_;
  uint64_t syscall_insn_ = 0;  // address of a `syscall` instruction in the target
  int pending_signal_ = 0;     // the signal the thread was stopped with, to re-deliver
  alignas(16) unsigned char saved_regs_[512] = {};
  bool attached_ = false;
};

// A mapping of a process as /proc/PID/maps lists it.
struct Mapping {
  uint64_t start = 0;
  uint64_t end = 0;
  std::string perms;  // "rw-p"
  uint64_t offset = 0;
  std::string path;  // "" for anonymous memory, "[heap]", "[vdso]", a file path
  uint64_t size() const { return end - start; }
};

// Throws Error(kNotFound) when the process is gone.
std::vector<Mapping> read_mappings(pid_t pid);

}  // namespace gpusnap::common
