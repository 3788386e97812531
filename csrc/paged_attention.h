// Shared declarations of the CPU paged decode-attention kernel.
//
// Layout (fixed by common/attention/base.py):
//   key_cache   [num_blocks, num_kv_heads, head_dim, block_size]   K transposed inside a block
//   value_cache [num_blocks, num_kv_heads, block_size, head_dim]
// Token t of a sequence lives in block block_table[t / block_size], slot t % block_size.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "fragment.h"

namespace pm {

// A decode call, validated by the binding; pointers reference caller-owned tensors.
struct DecodeProblem {
  const void* q;  // [num_seqs, num_q_heads, head_dim], float32 or bfloat16
  bool q_is_bf16;
  const void* key_cache;
  const void* value_cache;
  KvDtype kv_dtype;
  const int32_t* block_tables;   // [num_seqs, max_blocks]
  const int32_t* context_lens;   // [num_seqs]
  const int32_t* token_starts;   // [num_seqs] or nullptr
  float* out;                    // [num_seqs, num_q_heads, head_dim]
  float* lse;                    // [num_seqs, num_q_heads]
  float scale;
  int64_t num_seqs, num_q_heads, head_dim;
  int64_t num_blocks, num_kv_heads, block_size, max_blocks;
  int64_t kv_head_start, kv_head_end;
};

// Scratch kept across calls so that no call allocates (or first-touches) fresh memory once the
// largest shape has been seen. A mutex serialises callers that share one workspace.
struct Workspace {
  std::vector<int64_t> segment_units;  // prefix sums of blocks per (sequence, KV head)
  std::vector<float> partials;         // flash-decoding split: two fragments per range
  std::vector<float> thread_scratch;   // per-thread q, accumulators and scores
  std::mutex mutex;
};

// Picks the kernels for `isa` ("auto", "avx512", "avx2", "avx2_w16", "generic"); throws
// std::invalid_argument if that ISA is unknown or this CPU lacks it.
const IsaKernels& select_isa(const std::string& isa, int64_t head_dim, int64_t block_size);
std::vector<std::string> supported_isas();
// The best ISA this CPU runs (for the layer ops, which have no shape constraint).
const IsaKernels& best_isa();
// Where the attention kernel's prefetches go on this CPU's cores (isa_select.cpp).
PrefetchTo attention_prefetch_target();

// Sums n floats with num_threads threads: a memory read-bandwidth probe for the benchmark.
double read_sum(const float* data, int64_t n, int num_threads);
// Copies n bytes with num_threads threads: a copy-bandwidth probe for the benchmark.
void copy_bytes(void* dst, const void* src, int64_t n, int num_threads);

// Validates block ids and lengths (throws std::invalid_argument), then runs the decode.
void run_decode(const DecodeProblem& p, const IsaKernels& isa, int num_threads, Workspace& ws);

}  // namespace pm
