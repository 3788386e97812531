// The kernels' pool (csrc/thread_pool.h): what one parallel call costs at 2 threads beyond its
// work, the question behind fusing a layer's ~6 pool calls into one parallel region.
//
//   g++ -O2 -std=c++17 -pthread -Icsrc bench/pool_dispatch.cpp csrc/thread_pool.cpp \
//       -o /tmp/pool_dispatch && /tmp/pool_dispatch
//
// Per shape (units x busy-wait nanoseconds per unit), calls at 2 threads and at 1 thread
// alternate; it reports each side's median microseconds per call, the 2-thread call's median
// over the 1-thread one's minus the work the caller would have done alone (`overhead_us`), and
// the share of units the worker ran (0 when the worker never got a core: a loaded machine).
// The last line is one JSON object with `targets` and `targets_met`.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <vector>

#include "thread_pool.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kCalls = 20000;
// An empty call's cost at 2 threads over 1 thread, microseconds: above it, ~150 pool calls a
// decode step would be worth fusing into fewer parallel regions.
constexpr double kTargetEmptyOverheadUs = 1.0;

void busy_ns(double ns) {
  const auto start = Clock::now();
  while (std::chrono::duration<double, std::nano>(Clock::now() - start).count() < ns) {
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Shape {
  int units;
  double unit_ns;
};

}  // namespace

int main() {
  const Shape shapes[] = {{2, 0}, {36, 0}, {2, 2000}, {36, 500}};
  std::printf("{\"shapes\": [");
  double empty_overhead = 0;
  for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); ++s) {
    const Shape shape = shapes[s];
    std::atomic<long> by_worker{0}, total{0};
    auto job = [&](int64_t, int participant) {
      busy_ns(shape.unit_ns);
      total.fetch_add(1, std::memory_order_relaxed);
      if (participant) by_worker.fetch_add(1, std::memory_order_relaxed);
    };
    std::vector<double> two, one;
    for (int i = 0; i < kCalls; ++i) {
      const auto a = Clock::now();
      pm::parallel_units(shape.units, 2, job);
      const auto b = Clock::now();
      pm::parallel_units(shape.units, 1, job);
      const auto c = Clock::now();
      two.push_back(std::chrono::duration<double, std::micro>(b - a).count());
      one.push_back(std::chrono::duration<double, std::micro>(c - b).count());
    }
    const double two_us = median(two), one_us = median(one);
    const double worker_share = static_cast<double>(by_worker) / static_cast<double>(total);
    // What the caller would have spent alone on the units it left to the worker is not a cost.
    const double overhead = two_us - one_us * (1 - worker_share);
    if (shape.unit_ns == 0) empty_overhead = std::max(empty_overhead, two_us - one_us);
    std::printf("%s{\"units\": %d, \"unit_ns\": %.0f, \"two_threads_us\": %.3f, "
                "\"one_thread_us\": %.3f, \"overhead_us\": %.3f, \"worker_share\": %.3f}",
                s ? ", " : "", shape.units, shape.unit_ns, two_us, one_us, overhead,
                worker_share);
  }
  std::printf("], \"empty_call_overhead_us\": %.3f, \"targets\": {\"empty_call_overhead_us\": %.1f}, "
              "\"targets_met\": {\"empty_call_overhead_us\": %s}}\n",
              empty_overhead, kTargetEmptyOverheadUs,
              empty_overhead <= kTargetEmptyOverheadUs ? "true" : "false");
}
