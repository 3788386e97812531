// Writes one step's new k/v rows into the paged caches (vLLM's reshape_and_cache, CPU, float32).
//
// NOTE: why: torch's version is two advanced-index assignments plus the slot arithmetic, slow with
// k/v arriving as strided views of the fused qkv projection; this loop writes the same bytes in
// one pass.
#include <cstdint>

#include "layer_ops.h"

namespace pm {

void write_kv(float* key_cache, float* value_cache, const float* k, const float* v,
              const int64_t* slots, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
              int64_t block_size, const KvRowStrides& strides) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* k_row = k + t * strides.k_token + h * strides.k_head;
      const float* v_row = v + t * strides.v_token + h * strides.v_head;
      float* k_dst = key_cache + ((block * num_heads + h) * head_dim) * block_size + offset;
      float* v_dst = value_cache + ((block * num_heads + h) * block_size + offset) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) k_dst[d * block_size] = k_row[d];  // K is [D][bs]
      for (int64_t d = 0; d < head_dim; ++d) v_dst[d] = v_row[d];
    }
  }
}

}  // namespace pm
