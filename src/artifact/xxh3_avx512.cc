// XXH3's updates for AVX-512 (compiled with -mavx512f; artifact/xxh3.h chooses them at run time).
#define GPUSNAP_XXH3_WIDTH avx512
#include "artifact/xxh3_wide.inc"
