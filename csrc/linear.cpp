// The projections' GEMM (linear_kernel.h) split over threads by column panels: a unit of work is
// a range of whole panels, so a row's outputs do not depend on the split or on who ran a unit.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "layer_ops.h"
#include "thread_pool.h"

namespace pm {

namespace {

// Units handed out per thread: enough that a thread which loses its core mid-call holds up only
// a small share (the others take the rest), few enough that each unit reads whole panels.
constexpr int64_t kUnitsPerThread = 8;

// work(begin, end) over ranges of [0, num_panels) that cover it once, on the calling thread and
// the kernels' pool (thread_pool.h): on the calling thread alone for one thread or no rows. A
// range holds at least `unit_panels` panels where there are that many (the panels a tile of the
// call's rows reads side by side: a smaller range would run its tiles on fewer FMA chains).
template <typename Work>
void over_panels(int64_t num_panels, int num_threads, int64_t rows, int64_t unit_panels,
                 const Work& work) {
  if (num_threads <= 1 || rows == 0 || num_panels <= 1) return work(int64_t{0}, num_panels);
  const int64_t wanted = num_threads * kUnitsPerThread;
  const int64_t most = num_panels / unit_panels > 1 ? num_panels / unit_panels : 1;
  const int64_t units = most < wanted ? most : wanted;
  parallel_units(units, num_threads, [&](int64_t unit, int) {
    work(num_panels * unit / units, num_panels * (unit + 1) / units);
  });
}

std::atomic<MatmulPrecision> g_precision{MatmulPrecision::kHighest};
std::atomic<bool> g_products_as_fmas{false};

// `a` as the process's matmul precision computes it: under kMedium, bfloat16 weights take x
// rounded to bfloat16 pairs (kBfloat16Products), once per call on the calling thread before the
// threads share it, into this thread's buffer (a call reads it until it returns, and a thread
// makes its calls one after another).
LinearArgs at_precision(const LinearArgs& a, const IsaKernels& isa) {
  if (a.weight_dtype != WeightDtype::kBfloat16 ||
      g_precision.load(std::memory_order_relaxed) != MatmulPrecision::kMedium)
    return a;
  thread_local std::vector<uint32_t> pairs;
  pairs.resize(static_cast<size_t>(a.rows * ((a.in_features + 1) / 2)));
  isa.round_bf16_pairs(a.x, a.rows, a.in_features, a.x_stride, pairs.data());
  LinearArgs b = a;
  b.weight_dtype = WeightDtype::kBfloat16Products;
  b.x_pairs = pairs.data();
  b.products_as_fmas = g_products_as_fmas.load(std::memory_order_relaxed);
  return b;
}

}  // namespace

void set_matmul_precision(MatmulPrecision precision) { g_precision.store(precision); }

MatmulPrecision matmul_precision() { return g_precision.load(); }

void set_bf16_products_as_fmas(bool as_fmas) { g_products_as_fmas.store(as_fmas); }

void linear(const LinearArgs& args, const IsaKernels& isa, int64_t num_panels, int num_threads) {
  const LinearArgs a = at_precision(args, isa);
  over_panels(num_panels, num_threads, a.rows, isa.linear_tile_panels(a.rows),
              [&](int64_t begin, int64_t end) { isa.linear_panels(a, begin, end); });
}

// NOTE: the fused MLP (gate|up, activation, down) ran within noise of the two-call form in
// alternated runs; kept because its values are the same bits and nothing crosses cores for it.
void linear_silu_and_mul(const LinearArgs& args, float* act, const IsaKernels& isa,
                         int64_t num_gate_panels, int num_threads) {
  const LinearArgs a = at_precision(args, isa);
  const int64_t width = isa.linear_panel_width, inter = num_gate_panels * width;
  // Gate panels [begin, end), the up panels with the same columns, then their activation: the
  // activation reads only what this thread just wrote, from its own cache.
  const int64_t unit_panels = isa.linear_tile_panels(a.rows);
  over_panels(num_gate_panels, num_threads, a.rows, unit_panels, [&](int64_t begin, int64_t end) {
    isa.linear_panels(a, begin, end);
    isa.linear_panels(a, num_gate_panels + begin, num_gate_panels + end);
    isa.silu_and_mul(a.out, act, a.rows, inter, begin * width, end * width);
  });
}

}  // namespace pm
