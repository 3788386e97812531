// AVX-512 kernels (16 floats per zmm, 32 registers). Built with -mavx512f; isa_select.cpp runs
// them only where the CPU has it.
#include <immintrin.h>

#include <cstdint>

#include "fragment.h"

#define PM_LANES 16
#define PM_ACC_BUDGET 16
#define PM_ISA_NAME "avx512"
#define PM_LINEAR_ROWS 12  // rows per GEMM tile: rows x 2 vector accumulators in registers
#define PM_TILE_CHAINS 8  // independent FMA chains a GEMM tile keeps (linear_kernel.h)

namespace pm::isa_avx512 {
#include "fragment_kernel.h"
}  // namespace pm::isa_avx512
