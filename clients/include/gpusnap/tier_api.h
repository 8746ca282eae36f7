/* The memory tier's C interface: libgpusnap-tier.so, built and shipped next to
 * libgpusnap-preload.so (docs/memory-tier.md).
 *
 * A workload that allocates its GPU memory through tier_malloc/tier_free lets gpusnap move that
 * memory itself at line rate: at a pause the handshake client drains it into the artifact
 * (gpusnap_tier_drain) and releases the physical memory, keeping every address; at a resume it
 * maps memory at the same addresses again and fills it (gpusnap_tier_fill) before the workload
 * answers `resumed`. PyTorch workloads get all of this from
 * gpusnap_handshake.use_memory_tier(); a C++ workload links or dlopens the library, allocates
 * with tier_malloc, and calls Client::use_memory_tier() (handshake_client.h), which makes its
 * handshake client drain and fill.
 *
 * Thread-safety: every function may be called from any thread. Errors: the int-returning
 * functions return 0 on success, else a gpusnap exit code (8: the GPU driver failed, 4: a damaged
 * file, 5: the wrong GPU, 1: anything else) and write a one-line message into `error` (always
 * NUL-terminated, cut to error_size). Plain C, so that any language can call it.
 */
#ifndef GPUSNAP_TIER_H_
#define GPUSNAP_TIER_H_

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* PyTorch's CUDAPluggableAllocator entry points. `stream` is a cudaStream_t (a CUstream). A null
 * result means out of memory (or the tier is drained, or the driver could not be loaded):
 * gpusnap_tier_last_error says which. */
void* tier_malloc(ssize_t size, int device, void* stream);
void tier_free(void* ptr, ssize_t size, int device, void* stream);

/* Writes every live allocation into files in `dir` (an existing folder; the handshake's
 * `tier_dir`), then releases the physical memory and keeps the addresses. On failure nothing is
 * released. */
int gpusnap_tier_drain(const char* dir, char* error, size_t error_size);
/* Takes over the memory gpusnap-tier-prefill made and filled for this process while the copy
 * was restored, offered on the socket PID.sock in `dir` (the resume context's
 * `tier_prefill_dir`); `*adopted` receives the bytes taken (0: nothing to take, or `dir` NULL or
 * ""). On failure nothing it took stays mapped: gpusnap_tier_fill then fills everything. Call
 * gpusnap_tier_fill afterwards in every case: it fills what is left and returns the tier to
 * serving. */
int gpusnap_tier_adopt(const char* dir, unsigned long long* adopted, char* error,
                       size_t error_size);
/* Maps memory at every address again and fills it from `dir` (NULL or "": the folder of the last
 * drain). `gpu_map` is "OLD=NEW;OLD=NEW" with GPU UUIDs (NULL or "": none). On failure nothing
 * stays mapped and the tier stays drained; calling it again retries. A no-op while serving. */
int gpusnap_tier_fill(const char* dir, const char* gpu_map, char* error, size_t error_size);

enum gpusnap_tier_state_value {
  GPUSNAP_TIER_UNUSED = 0,  /* nothing allocated yet */
  GPUSNAP_TIER_SERVING = 1, /* memory mapped */
  GPUSNAP_TIER_DRAINED = 2  /* contents in files, physical memory released */
};
int gpusnap_tier_state(void);
/* Bytes handed out and not freed (blocks of CUDA graphs included). */
unsigned long long gpusnap_tier_live_bytes(void);
/* The last error of tier_malloc or tier_free, as for the functions above. */
void gpusnap_tier_last_error(char* error, size_t error_size);

#ifdef __cplusplus
}
#endif

#endif /* GPUSNAP_TIER_H_ */
