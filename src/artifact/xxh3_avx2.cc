// XXH3's updates for AVX2 (compiled with -mavx2; artifact/xxh3.h chooses them at run time).
#define GPUSNAP_XXH3_WIDTH avx2
#include "artifact/xxh3_wide.inc"
