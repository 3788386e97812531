// A decoder layer in one call (decoder_layer.h): the pieces the separate bindings run, composed
// in C++ so that a decode step pays one Python-to-C++ crossing per layer instead of a dozen.
#include "decoder_layer.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace pm {

namespace {

int64_t panels_for(int64_t columns, int64_t width) { return (columns + width - 1) / width; }

// out [rows, out_features] = x [rows, in_features] @ w.T (+ residual [rows, out_features]), all
// rows contiguous: what the `linear` binding runs from panel 0.
void dense_linear(const float* x, const WeightView& w, float* out, const float* residual,
                  int64_t rows, int64_t in_features, int64_t out_features, const IsaKernels& gemm,
                  int num_threads) {
  linear({x, w.panels, out, residual, rows, in_features, out_features, in_features, out_features,
          out_features, w.dtype, w.scales},
         gemm, panels_for(out_features, gemm.linear_panel_width), num_threads);
}

}  // namespace

void post_attention(const PostAttentionWeights& w, const float* x, const float* attn, float* out,
                    int64_t rows, const IsaKernels& gemm, int num_threads) {
  const int64_t hidden = w.hidden, inter = w.inter;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(rows * (3 * hidden + 3 * inter)));
  float* o_out = scratch.data();
  float* sum = o_out + rows * hidden;
  float* normed = sum + rows * hidden;
  float* gate_up = normed + rows * hidden;
  float* act = gate_up + rows * 2 * inter;
  dense_linear(attn, w.o, o_out, nullptr, rows, w.attn_width, hidden, gemm, num_threads);
  add_rms_norm(x, o_out, w.norm_weight, sum, normed, rows, hidden, w.eps);
  linear_silu_and_mul({normed, w.gate_up.panels, gate_up, nullptr, rows, hidden, 2 * inter,
                       hidden, 2 * inter, 0, w.gate_up.dtype, w.gate_up.scales},
                      act, gemm, inter / gemm.linear_panel_width, num_threads);
  dense_linear(act, w.down, out, sum, rows, inter, hidden, gemm, num_threads);
}

void lm_head(const LmHeadWeights& w, const float* x, float* logits, int64_t rows,
             const IsaKernels& gemm, int num_threads) {
  thread_local std::vector<float> normed;
  normed.resize(static_cast<size_t>(rows * w.hidden));
  rms_norm(x, w.norm_weight, normed.data(), rows, w.hidden, w.eps);
  dense_linear(normed.data(), w.head, logits, nullptr, rows, w.hidden, w.vocab, gemm, num_threads);
}

void decoder_layer_decode(const PreAttentionWeights& pre, const PostAttentionWeights& post,
                          const KvLayer& kv, const DecodeStepInputs& step, const float* x,
                          float* out, const IsaKernels& gemm, const IsaKernels& attention,
                          Workspace& ws, int num_threads, int attention_threads) {
  const int64_t rows = step.rows, D = pre.head_dim, width = pre.qkv_width();
  const int64_t q_width = pre.num_heads * D, kv_width = pre.num_kv_heads * D;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(rows * (pre.hidden + width + 2 * q_width + pre.num_heads)));
  float* normed = scratch.data();
  float* qkv = normed + rows * pre.hidden;
  float* q = qkv + rows * width;
  float* attn = q + rows * q_width;
  float* lse = attn + rows * q_width;
  // Pre-attention (LlamaDecoderLayer.pre_attention): q and k side by side, rotated in one pass.
  rms_norm(x, pre.norm_weight, normed, rows, pre.hidden, pre.eps);
  dense_linear(normed, pre.qkv, qkv, nullptr, rows, pre.hidden, width, gemm, num_threads);
  rotary_inplace(qkv, rows, width, pre.num_heads + pre.num_kv_heads, D, step.positions,
                 step.cos_table, step.sin_table);
  // The new k/v (strided views of qkv's rows) into the cache, then attention over it.
  const KvRowStrides strides{width, D, width, D};
  if (kv.dtype == KvDtype::kBfloat16)
    write_kv_bf16(static_cast<uint16_t*>(kv.key_cache), static_cast<uint16_t*>(kv.value_cache),
                  qkv + q_width, qkv + q_width + kv_width, step.slots, rows, pre.num_kv_heads, D,
                  kv.block_size, strides);
  else
    write_kv(static_cast<float*>(kv.key_cache), static_cast<float*>(kv.value_cache),
             qkv + q_width, qkv + q_width + kv_width, step.slots, rows, pre.num_kv_heads, D,
             kv.block_size, strides);
  for (int64_t r = 0; r < rows; ++r)  // the kernel takes q rows back to back
    std::copy(qkv + r * width, qkv + r * width + q_width, q + r * q_width);
  DecodeProblem p{};
  p.q = q, p.q_is_bf16 = false;
  p.key_cache = kv.key_cache, p.value_cache = kv.value_cache, p.kv_dtype = kv.dtype;
  p.block_tables = step.block_tables, p.context_lens = step.context_lens, p.token_starts = nullptr;
  p.out = attn, p.lse = lse, p.scale = step.scale;
  p.num_seqs = rows, p.num_q_heads = pre.num_heads, p.head_dim = D;
  p.num_blocks = kv.num_blocks, p.num_kv_heads = pre.num_kv_heads;
  p.block_size = kv.block_size, p.max_blocks = step.max_blocks;
  p.kv_head_start = 0, p.kv_head_end = pre.num_kv_heads;
  {
    std::lock_guard<std::mutex> lock(ws.mutex);
    run_decode(p, attention, attention_threads, ws);
  }
  post_attention(post, x, attn, out, rows, gemm, num_threads);
}

}  // namespace pm
