// What an ISA translation unit sees: one fragment of decode attention and its running state.
//
// NOTE: the ISA units are compiled with -mavx512f / -mavx2, so they include nothing but this
// header, <cstdint> and <immintrin.h>: an inline std:: function instantiated there could be picked
// by the linker for the portable code too and fault on a CPU without those instructions
// (`nm` on each fragment_*.o shows one exported symbol, its kernel table, and no weak ones).
#pragma once

#include <cstdint>
#include <type_traits>

namespace pm {

constexpr int kMaxLanes = 16;  // widest SIMD vector in floats (AVX-512)
// Tokens per online-softmax step, float32 and bfloat16 alike: a few blocks share one
// max/rescale and one pass over V, and their tiles are read side by side (8 blocks of 16: eight
// streams of lines in flight). See the NOTE on step sizes in fragment_kernel.h.
constexpr int kStepSlots = 128;
constexpr int kMaxStepBlocks = kStepSlots / 4;  // block_size is a multiple of 4 (the narrowest ISA)

enum class KvDtype { kFloat32, kBfloat16 };

// One fragment: one query group (the group_size query heads that share a KV head) against the
// blocks [block_begin, block_end) of one sequence, restricted to tokens [token_lo, token_hi).
struct FragmentArgs {
  const float* q;               // [group_size, head_dim], already multiplied by the scale
  const void* key_cache;        // base of the whole cache
  const void* value_cache;
  const int32_t* block_table;   // this sequence's row
  int64_t head_tile_offset;     // elements from a block's start to this KV head's tile
  int64_t block_stride;         // elements per block (num_kv_heads * head_dim * block_size)
  int64_t block_begin, block_end;
  int64_t token_lo, token_hi;
  int group_size, head_dim, block_size;
  // The fragment this thread runs next (same caches and block_stride): its blocks
  // [next_block_begin, next_block_end) of the row next_block_table, its KV head's tile at
  // next_head_tile_offset. The last steps prefetch its first tiles as if the walk went on into
  // it; next_block_table is nullptr where no fragment follows on this thread.
  const int32_t* next_block_table = nullptr;
  int64_t next_head_tile_offset = 0;
  int64_t next_block_begin = 0, next_block_end = 0;
};

// Running flash-attention state of one fragment: unnormalized output, running max and sum.
struct FragmentState {
  float* acc;      // [group_size, head_dim]
  float* row_max;  // [group_size]
  float* row_sum;  // [group_size]
  float* scratch;  // group_size * (max(kStepSlots, block_size) + 1 + kMaxLanes) floats
};

using FragmentFn = void (*)(const FragmentArgs&, const FragmentState&);

// Where a fragment's prefetches bring the tiles it reads next (attention_prefetch_target).
enum class PrefetchTo { kL1 = 0, kL2 = 1 };

// The projections' weight element types (linear_kernel.h): float32, bfloat16 (widened exactly to
// float32) and int8 with one float32 scale per output column (w[c, k] = q[c, k] * scale[c]).
// kBfloat16Products: the same bfloat16 panels, multiplied by x rounded to bfloat16 (the matmul
// precision "medium", set_matmul_precision in bindings.cpp): each product is exact in float32, as
// vdpbf16ps computes it, at twice the products per instruction of widening and FMAs.
enum class WeightDtype { kFloat32, kBfloat16, kInt8, kBfloat16Products };

// A projection on a panel-packed weight (linear_kernel.h): out = x @ w.T (+ residual).
struct LinearArgs {
  const float* x;         // [rows, in_features], rows x_stride floats apart
  const void* panels;     // [num_panels, in_features, panel_width] of weight_dtype, from the
                          // first panel used
  float* out;             // [rows, out_features], rows out_stride floats apart
  const float* residual;  // like out, or nullptr
  int64_t rows, in_features, out_features;  // out_features: columns from the first panel used
  int64_t x_stride, out_stride, res_stride;
  WeightDtype weight_dtype = WeightDtype::kFloat32;
  const float* scales = nullptr;  // kInt8: one per column, from the first panel used's first
  // kBfloat16Products: x rounded to bfloat16 (round_bf16_pairs), each row (in_features + 1) / 2
  // 32-bit pairs, element k in the low half of pair k / 2, the rows contiguous; set by linear().
  const uint32_t* x_pairs = nullptr;
  // kBfloat16Products as FMAs even on a CPU with vdpbf16ps (the form other CPUs run): for tests.
  bool products_as_fmas = false;
};
// Writes the columns of panels [panel_begin, panel_end) (relative to `panels`) for every row.
using LinearPanelsFn = void (*)(const LinearArgs&, int64_t panel_begin, int64_t panel_end);
// out[r, c] = silu(x[r, c]) * x[r, inter + c] for rows r and columns c in [col_begin, col_end)
// (x [rows, 2 * inter], out [rows, inter]).
using SiluAndMulFn = void (*)(const float* x, float* out, int64_t rows, int64_t inter,
                              int64_t col_begin, int64_t col_end);
// out: rows of (in + 1) / 2 pairs, x's rows (x_stride floats apart) rounded to bfloat16 (to the
// nearest, ties to even; NaN stays NaN), element k in the low half of pair k / 2, an odd row's
// last pair's high half zero. The layout LinearArgs::x_pairs takes.
using RoundBf16PairsFn = void (*)(const float* x, int64_t rows, int64_t in, int64_t x_stride,
                                  uint32_t* out);
// The first index of the row's largest value, or of its first NaN (numpy's argmax, which the
// sampler's greedy rows take); n >= 1.
using FirstArgmaxFn = int64_t (*)(const float* row, int64_t n);

// The two entry points every ISA translation unit provides.
struct IsaKernels {
  const char* name;
  int lanes;  // SIMD width in floats: block_size and head_dim must be multiples of it
  FragmentFn attend_f32[2];  // by PrefetchTo
  FragmentFn attend_bf16[2];
  SiluAndMulFn silu_and_mul;  // the MLP's activation, with this ISA's vector exp
  LinearPanelsFn linear_panels;
  int linear_panel_width;  // columns per weight panel (2 vectors)
  // Panels a call of `rows` rows reads side by side (linear_kernel.h): a unit of the call's
  // work holds at least that many, or its tiles would run on fewer FMA chains.
  int (*linear_tile_panels)(int64_t rows);
  RoundBf16PairsFn round_bf16_pairs;
  FirstArgmaxFn first_argmax;
};

namespace isa_generic { extern const IsaKernels kernels; }
namespace isa_avx2 { extern const IsaKernels kernels; }
namespace isa_avx2_w16 { extern const IsaKernels kernels; }
namespace isa_avx512 { extern const IsaKernels kernels; }

}  // namespace pm
