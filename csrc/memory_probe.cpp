// A streaming read probe: bench/attention.py measures the machine's read bandwidth with it in the
// same run as the kernel, so the kernel's bandwidth fraction is judged against a C-speed ceiling
// (torch.sum is itself compute-bound at ~0.8 of it on this machine).
#include <cstdint>

#include "paged_attention.h"

namespace pm {

typedef float Vec8 __attribute__((vector_size(32)));

double read_sum(const float* data, int64_t n, int num_threads) {
  constexpr int64_t kChunk = 1 << 16;  // floats per work item (256 KiB)
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  double total = 0.0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : total)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk, end = begin + kChunk < n ? begin + kChunk : n;
    Vec8 acc[4] = {};  // four independent sums keep the loads, not the adds, the limit
    int64_t i = begin;
    for (; i + 32 <= end; i += 32)
      for (int j = 0; j < 4; ++j) {
        Vec8 v;
        __builtin_memcpy(&v, data + i + 8 * j, sizeof v);
        acc[j] += v;
      }
    float sum = 0.0f;
    for (; i < end; ++i) sum += data[i];
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 8; ++k) sum += acc[j][k];
    total += sum;
  }
  return total;
}

}  // namespace pm
