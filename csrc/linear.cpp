// The projections' GEMM (linear_kernel.h) split over threads by column panels: each thread owns
// whole panels, so a row's outputs do not depend on the split.
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "layer_ops.h"

namespace pm {

namespace {

// work(begin, end) for ranges of [0, num_panels) split evenly over up to num_threads threads (a
// thread owns whole panels, so a row's outputs do not depend on the split); on the calling
// thread alone for one thread, no rows, or a build without OpenMP.
template <typename Work>
void over_panels(int64_t num_panels, int num_threads, int64_t rows, const Work& work) {
#ifdef _OPENMP
  const int64_t threads = num_threads < num_panels ? num_threads : num_panels;
  if (threads > 1 && rows > 0) {
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      work(num_panels * t / n, num_panels * (t + 1) / n);
    }
    return;
  }
#else
  (void)num_threads;
  (void)rows;
#endif
  work(int64_t{0}, num_panels);
}

}  // namespace

void linear(const LinearArgs& a, const IsaKernels& isa, int64_t num_panels, int num_threads) {
  over_panels(num_panels, num_threads, a.rows,
              [&](int64_t begin, int64_t end) { isa.linear_panels(a, begin, end); });
}

// NOTE: the fused MLP (gate|up, activation, down) ran within noise of the two-call form in
// alternated runs; kept because its values are the same bits and nothing crosses cores for it.
void linear_silu_and_mul(const LinearArgs& a, float* act, const IsaKernels& isa,
                         int64_t num_gate_panels, int num_threads) {
  const int64_t width = isa.linear_panel_width, inter = num_gate_panels * width;
  // Gate panels [begin, end), the up panels with the same columns, then their activation: the
  // activation reads only what this thread just wrote, from its own cache.
  over_panels(num_gate_panels, num_threads, a.rows, [&](int64_t begin, int64_t end) {
    isa.linear_panels(a, begin, end);
    isa.linear_panels(a, num_gate_panels + begin, num_gate_panels + end);
    isa.silu_and_mul(a.out, act, a.rows, inter, begin * width, end * width);
  });
}

}  // namespace pm
