// Writes one step's new k/v rows into the paged caches (vLLM's reshape_and_cache, CPU), float32 or
// bfloat16.
//
// NOTE: why: torch's version is two advanced-index assignments plus the slot arithmetic, slow with
// k/v arriving as strided views of the fused qkv projection; this loop writes the same bytes in
// one pass.
#include <cstdint>
#include <cstring>

#include "layer_ops.h"

namespace pm {

namespace {

// float32 to bfloat16 bits as c10::BFloat16 rounds: to the nearest, ties to even; NaN 0x7FC0.
uint16_t bf16_of(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename T, typename Convert>
void write_rows(T* key_cache, T* value_cache, const float* k, const float* v, const int64_t* slots,
                int64_t num_tokens, int64_t num_heads, int64_t head_dim, int64_t block_size,
                const KvRowStrides& strides, Convert convert) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* k_row = k + t * strides.k_token + h * strides.k_head;
      const float* v_row = v + t * strides.v_token + h * strides.v_head;
      T* k_dst = key_cache + ((block * num_heads + h) * head_dim) * block_size + offset;
      T* v_dst = value_cache + ((block * num_heads + h) * block_size + offset) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) k_dst[d * block_size] = convert(k_row[d]);  // [D][bs]
      for (int64_t d = 0; d < head_dim; ++d) v_dst[d] = convert(v_row[d]);
    }
  }
}

}  // namespace

void write_kv(float* key_cache, float* value_cache, const float* k, const float* v,
              const int64_t* slots, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
              int64_t block_size, const KvRowStrides& strides) {
  write_rows(key_cache, value_cache, k, v, slots, num_tokens, num_heads, head_dim, block_size,
             strides, [](float x) { return x; });
}

void write_kv_bf16(uint16_t* key_cache, uint16_t* value_cache, const float* k, const float* v,
                   const int64_t* slots, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                   int64_t block_size, const KvRowStrides& strides) {
  write_rows(key_cache, value_cache, k, v, slots, num_tokens, num_heads, head_dim, block_size,
             strides, bf16_of);
}

}  // namespace pm
