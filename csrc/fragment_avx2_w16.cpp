// The 16-lane kernels lowered to AVX2 (each vector is two ymm): lets a machine without AVX-512
// run and test the exact code path the AVX-512 build takes (one vector per 16-slot block row).
#include <immintrin.h>

#include <cstdint>

#include "fragment.h"

#define PM_LANES 16
#define PM_ACC_BUDGET 8
#define PM_ISA_NAME "avx2_w16"
#define PM_LINEAR_ROWS 2  // rows per GEMM tile: rows x 2 vector accumulators in registers
#define PM_TILE_CHAINS 4  // independent FMA chains a GEMM tile keeps (each a ymm pair)

namespace pm::isa_avx2_w16 {
#include "fragment_kernel.h"
}  // namespace pm::isa_avx2_w16
