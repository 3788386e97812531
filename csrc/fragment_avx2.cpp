// AVX2 + FMA kernels (8 floats per ymm, 16 registers). Built with -mavx2 -mfma.
#include <immintrin.h>

#include <cstdint>

#include "fragment.h"

#define PM_LANES 8
#define PM_ACC_BUDGET 8
#define PM_ISA_NAME "avx2"
#define PM_LINEAR_ROWS 4  // rows per GEMM tile: rows x 2 vector accumulators in registers
#define PM_TILE_CHAINS 8  // independent FMA chains a GEMM tile keeps (linear_kernel.h)
// Steps of 64 tokens (kStepSlots is 128): with 8 accumulators a GQA group's V loop passes over
// the step's V tiles many times (4 rows x 2 vectors a pass: 8 passes at head dim 128), and the
// V of a float32 step of 128 tokens (64 KiB) was re-read from L2 on each pass; 64-token steps
// ran faster in paired runs in both dtypes (docs/benchmarks/kernels.md).
#define PM_STEP_SLOTS 64

namespace pm::isa_avx2 {
#include "fragment_kernel.h"
}  // namespace pm::isa_avx2
