// A decoder layer's halves as the separate calls compose them, for one extension call per layer
// (decoder_layer.cpp): the bindings of `post_attention` and `decoder_layer_decode` run these, so
// a fused call and the calls it replaces go through the same functions in the same order.
#pragma once

#include <cstdint>

#include "layer_ops.h"
#include "paged_attention.h"

namespace pm {

// One projection's packed weight as the GEMM reads it: panels of `dtype` from the first panel
// used, and int8 panels' scales from that panel's first column (nullptr for other dtypes).
struct WeightView {
  WeightDtype dtype;
  const void* panels;
  const float* scales;
};

// Input RMSNorm, the fused QKV projection (q | k | v per row) and RoPE of q and k.
struct PreAttentionWeights {
  const float* norm_weight;  // [hidden]
  float eps;
  WeightView qkv;            // [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
  int64_t hidden, num_heads, num_kv_heads, head_dim;
  int64_t qkv_width() const { return (num_heads + 2 * num_kv_heads) * head_dim; }
};

// O projection, the residual add and RMSNorm, the gate|up projection, SwiGLU and the down
// projection with the residual.
struct PostAttentionWeights {
  WeightView o;              // [hidden, attn_width]
  const float* norm_weight;  // [hidden]
  float eps;
  WeightView gate_up;        // [2 * inter, hidden]
  WeightView down;           // [hidden, inter]
  int64_t hidden, attn_width, inter;
};

// What every layer of one decode step shares: the rows' positions, the RoPE tables, the KV slots
// the new k/v go to, and the rows' block tables and context lengths (token t of row r attends to
// its first context_lens[r] tokens). All checked by the binding.
struct DecodeStepInputs {
  int64_t rows;
  const int64_t* positions;  // [rows], each in [0, max_pos)
  const float* cos_table;    // [max_pos, head_dim]
  const float* sin_table;
  const int64_t* slots;      // [rows], each in [0, num_blocks * block_size)
  const int32_t* block_tables;  // [rows, max_blocks]
  const int32_t* context_lens;  // [rows]
  int64_t max_blocks;
  float scale;
};

// The final RMSNorm and the LM head after the last layer: logits [rows, vocab] =
// rms_norm(x) @ head.T.
struct LmHeadWeights {
  const float* norm_weight;  // [hidden]
  float eps;
  WeightView head;           // [vocab, hidden]
  int64_t hidden, vocab;
};

// One layer's paged caches (layout: paged_attention.h), float32 or bfloat16 (then each new k/v
// is rounded as torch's `.to(torch.bfloat16)` rounds it: write_kv_bf16).
struct KvLayer {
  void* key_cache;
  void* value_cache;
  int64_t num_blocks, block_size;
  KvDtype dtype;
};

// out [rows, hidden] = sum + mlp(rms_norm(sum)), sum = x + attn @ Wo.T; the bits of linear,
// add_rms_norm, linear_silu_and_mul and linear called in turn. Intermediates live in the calling
// thread's scratch.
void post_attention(const PostAttentionWeights& w, const float* x, const float* attn, float* out,
                    int64_t rows, const IsaKernels& gemm, int num_threads);

// logits [rows, vocab] = the LM head on the final norm of x [rows, hidden]: the bits of rms_norm
// then linear (from panel 0) called in turn. The normed rows live in the calling thread's scratch.
void lm_head(const LmHeadWeights& w, const float* x, float* logits, int64_t rows,
             const IsaKernels& gemm, int num_threads);

// A whole decoder layer of a decode step: pre-attention, the k/v write at the step's slots, paged
// decode attention over each row's context (the new token included) and post-attention, each the
// function its own call runs, so `out` has the bits of rms_norm, linear, rotary, write_kv,
// PagedDecodeKernel.decode (on `attention_threads`) and post_attention called in turn with the
// same thread counts. x and out may be the same rows: x is read whole before out is written.
void decoder_layer_decode(const PreAttentionWeights& pre, const PostAttentionWeights& post,
                          const KvLayer& kv, const DecodeStepInputs& step, const float* x,
                          float* out, const IsaKernels& gemm, const IsaKernels& attention,
                          Workspace& ws, int num_threads, int attention_threads);

}  // namespace pm
