// The projections' GEMM (linear_kernel.h) split over threads by column panels: each thread owns
// whole panels, so a row's outputs do not depend on the split.
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "layer_ops.h"

namespace pm {

void linear(const LinearArgs& a, const IsaKernels& isa, int64_t num_panels, int num_threads) {
#ifdef _OPENMP
  const int64_t threads = num_threads < num_panels ? num_threads : num_panels;
  if (threads > 1 && a.rows > 0) {
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      isa.linear_panels(a, num_panels * t / n, num_panels * (t + 1) / n);
    }
    return;
  }
#else
  (void)num_threads;  // a build without OpenMP runs on the calling thread
#endif
  isa.linear_panels(a, 0, num_panels);
}

}  // namespace pm
