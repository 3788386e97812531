// Streaming memory probes: bench/attention.py measures the machine's memory bandwidth with them in
// the same run as the kernel, so the kernel's bandwidth fraction is judged against a C-speed
// ceiling measured under the same load (torch.sum is itself compute-bound, below it).
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "paged_attention.h"

namespace pm {

typedef float Vec8 __attribute__((vector_size(32)));

// NOTE: a read probe that reads the way a good kernel can: each thread walks its chunk as
// kStreams interleaved sub-streams with software prefetch ahead of each. One sequential stream
// per thread reads well below what several streams with prefetch do: a single-stream sum measures
// the core's memory-level parallelism, not the memory, and a kernel reading scattered blocks side
// by side beats it.
double read_sum(const float* data, int64_t n, int num_threads) {
  constexpr int64_t kChunk = 1 << 16;        // floats per work item (256 KiB)
  constexpr int64_t kStreams = 8;            // interleaved sub-streams per chunk
  constexpr int64_t kStream = kChunk / kStreams;
  constexpr int64_t kAhead = 256;            // floats prefetched ahead in each sub-stream (1 KiB)
  const int64_t num_chunks = n / kChunk;
  double total = 0.0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : total)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const float* base = data + c * kChunk;
    Vec8 acc[kStreams] = {};
    for (int64_t i = 0; i < kStream; i += 16) {  // one 64-byte line per sub-stream per turn
      for (int64_t s = 0; s < kStreams; ++s) {
        const float* p = base + s * kStream + i;
        if (i + kAhead < kStream) __builtin_prefetch(p + kAhead, 0, 3);
        Vec8 lo, hi;
        __builtin_memcpy(&lo, p, sizeof lo);
        __builtin_memcpy(&hi, p + 8, sizeof hi);
        acc[s] += lo + hi;
      }
    }
    float sum = 0.0f;
    for (int64_t s = 0; s < kStreams; ++s)
      for (int k = 0; k < 8; ++k) sum += acc[s][k];
    total += sum;
  }
  for (int64_t i = num_chunks * kChunk; i < n; ++i) total += data[i];  // the tail
  return total;
}

// NOTE: each thread copies one contiguous share with non-temporal (streaming) stores, so the bytes
// moved are the bytes counted: read + written, no read-for-ownership of the destination. Not
// glibc's memcpy: it streams only above ~3/4 of the L3 share per thread (on a VM that reports a
// large L3, a share per thread took the cached path at well under the streaming copy's rate), so
// the ceiling would depend on the buffer size. SSE2 stores are
// enough: the write-combining buffers fill whole lines either way.
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
    char* d = static_cast<char*>(dst) + begin;
    const char* s = static_cast<const char*>(src) + begin;
    int64_t done = 0;
#if defined(__SSE2__)
    if (reinterpret_cast<uintptr_t>(d) % 16 == 0) {
      for (; done + 64 <= end - begin; done += 64) {
        const __m128i* from = reinterpret_cast<const __m128i*>(s + done);
        __m128i* to = reinterpret_cast<__m128i*>(d + done);
        const __m128i a = _mm_loadu_si128(from), b = _mm_loadu_si128(from + 1);
        const __m128i c = _mm_loadu_si128(from + 2), e = _mm_loadu_si128(from + 3);
        _mm_stream_si128(to, a);
        _mm_stream_si128(to + 1, b);
        _mm_stream_si128(to + 2, c);
        _mm_stream_si128(to + 3, e);
      }
      _mm_sfence();  // the streamed lines are visible before the timer stops
    }
#endif
    std::memcpy(d + done, s + done, end - begin - done);
  }
}

}  // namespace pm
