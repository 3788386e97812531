// Fused elementwise steps of a decoder layer (layer_ops.cpp) and the paged KV write
// (kv_write.cpp), and the projections' GEMM (linear.cpp); float32.
#pragma once

#include <cstdint>

#include "fragment.h"

namespace pm {

// out = x / rms(x) * weight, per row of `hidden` floats.
void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t hidden,
              float eps);

// sum = x + y; normed = sum / rms(sum) * weight (the residual add before a norm, in one pass).
void add_rms_norm(const float* x, const float* y, const float* weight, float* sum, float* normed,
                  int64_t rows, int64_t hidden, float eps);

// Rotates, in place, the first `num_heads` heads of each row (rows `row_stride` floats apart) by
// the row's position: x * cos + rotate_half(x) * sin, with cos/sin tables [max_pos, head_dim].
void rotary_inplace(float* rows, int64_t num_rows, int64_t row_stride, int64_t num_heads,
                    int64_t head_dim, const int64_t* positions, const float* cos_table,
                    const float* sin_table);

// Element strides of the k/v inputs [T, H, D] (the head_dim stride must be 1).
struct KvRowStrides {
  int64_t k_token, k_head, v_token, v_head;
};

// key_cache [num_blocks, H, D, block_size] and value_cache [num_blocks, H, block_size, D] of one
// layer receive token t's k/v [H, D] at flat slot slots[t] (kv_write.cpp; slots are checked by
// the caller).
void write_kv(float* key_cache, float* value_cache, const float* k, const float* v,
              const int64_t* slots, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
              int64_t block_size, const KvRowStrides& strides);
// write_kv into bfloat16 caches: each value rounded to the nearest bfloat16, ties to even, a NaN
// to the quiet NaN 0x7FC0 (c10::BFloat16's conversion, what `tensor.to(torch.bfloat16)` does).
void write_kv_bf16(uint16_t* key_cache, uint16_t* value_cache, const float* k, const float* v,
                   const int64_t* slots, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                   int64_t block_size, const KvRowStrides& strides);

// How the projections multiply bfloat16 weights, for the whole process (torch's
// set_float32_matmul_precision has the same two words): kHighest widens them to float32 and keeps
// x float32 (the default); kMedium rounds x to bfloat16 and multiplies in bfloat16 pairs
// (WeightDtype::kBfloat16Products). Read by every linear call as it starts; float32 and int8
// weights are not affected.
enum class MatmulPrecision { kHighest, kMedium };
void set_matmul_precision(MatmulPrecision precision);
MatmulPrecision matmul_precision();
// kMedium's products as FMAs even where the CPU runs vdpbf16ps (the form of CPUs without it):
// for tests, which check that both give the same bits.
void set_bf16_products_as_fmas(bool as_fmas);

// out = x @ w.T (+ residual) on a weight packed into `num_panels` column panels of
// isa.linear_panel_width columns (linear_kernel.h), split by panels over num_threads threads.
void linear(const LinearArgs& a, const IsaKernels& isa, int64_t num_panels, int num_threads);

// The MLP's gate|up projection and its activation in one pass: a.out [rows, 2 * inter] receives
// x @ w.T (gate columns, then up columns; inter = num_gate_panels panels, so the up half starts
// on a panel boundary) and act [rows, inter] = silu(gate) * up. Each thread takes a range of
// gate panels with the up panels of the same columns and applies the activation to them itself,
// so no output crosses to another core; every value equals linear() then silu_and_mul().
void linear_silu_and_mul(const LinearArgs& a, float* act, const IsaKernels& isa,
                         int64_t num_gate_panels, int num_threads);

}  // namespace pm
