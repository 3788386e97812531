// Streaming memory probes: bench/attention.py measures the machine's memory bandwidth with them in
// the same run as the kernel, so the kernel's bandwidth fraction is judged against a C-speed
// ceiling measured under the same load (torch.sum is itself compute-bound at ~0.8 of it here).
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

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

// NOTE: each thread copies one contiguous share with glibc's memcpy, which is what a large copy
// in C does: above its size threshold memcpy streams with non-temporal stores, so the bytes moved
// are the bytes counted (read + written, no read-for-ownership of the destination).
void copy_bytes(void* dst, const void* src, int64_t n, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t t = 0, threads = 1;
#endif
    const int64_t share = (n / threads + 63) / 64 * 64;  // whole cache lines per thread
    const int64_t begin = t * share < n ? t * share : n;
    const int64_t end = begin + share < n ? begin + share : n;
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin,
                end - begin);
  }
}

}  // namespace pm
