// AVX2 + FMA kernels (8 floats per ymm, 16 registers). Built with -mavx2 -mfma.
#include <immintrin.h>

#include <cstdint>

#include "fragment.h"

#define PM_LANES 8
#define PM_ACC_BUDGET 8
#define PM_ISA_NAME "avx2"
#define PM_LINEAR_ROWS 4  // rows per GEMM tile: rows x 2 vector accumulators in registers
#define PM_TILE_CHAINS 8  // independent FMA chains a GEMM tile keeps (linear_kernel.h)

namespace pm::isa_avx2 {
#include "fragment_kernel.h"
}  // namespace pm::isa_avx2
