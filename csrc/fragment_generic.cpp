// Portable kernels (4 floats per vector): SSE2 on any x86-64, NEON or scalar code elsewhere.
#if defined(__SSE2__)
#include <emmintrin.h>  // the int8 widening (linear_kernel.h)
#endif

#include <cstdint>

#include "fragment.h"

#define PM_LANES 4
#define PM_ACC_BUDGET 8
#define PM_ISA_NAME "generic"
#define PM_LINEAR_ROWS 4  // rows per GEMM tile: rows x 2 vector accumulators in registers
#define PM_TILE_CHAINS 8  // independent FMA chains a GEMM tile keeps (linear_kernel.h)

namespace pm::isa_generic {
#include "fragment_kernel.h"
}  // namespace pm::isa_generic
