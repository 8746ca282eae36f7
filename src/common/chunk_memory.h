// The C heap set up for moving snapshots: chunks of up to tens of MiB are allocated, filled and
// freed by every transfer thread, one after another.
#pragma once

namespace gpusnap::common {

// Called by the transfers (store::push, store::pull) before their first chunk, so that a
// capture that moves no snapshot keeps glibc's defaults; process-wide, the same each time. glibc
// serves an allocation above its mmap threshold with a fresh mapping and gives it back at
// free(), and trims a heap's top above its trim threshold: either way every chunk's buffer is
// new memory, and its first touch page-faults through it. Raising both keeps freed chunks'
// pages for the next chunk. On the development machine a
// 1.07 GB pull took 26-27 thousand page faults and 2.62-2.72 CPU seconds against 38-39
// thousand and 3.09 s (docs/benchmarks.md, "Pull against the registry's ceiling").
void keep_chunk_memory();

// Gives the heap's free pages back to the kernel: for a long-running process (the agent) once an
// operation has ended, so that what a pull kept for its chunks is not held while idle.
void release_free_memory() noexcept;

}  // namespace gpusnap::common
