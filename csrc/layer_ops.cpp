// The decoder layer's small elementwise steps, fused: RMSNorm (optionally with the residual add
// before it) and rotary position embedding applied in place. float32 only.
//
// NOTE: why these exist: at decode shapes (a few dozen rows of a few hundred floats) each torch op
// costs more in dispatch and allocation than its arithmetic, and with 2 intra-op threads torch's
// rms_norm also pays an OpenMP fork/join; torch's RoPE is six ops. One pass in C++ is a few
// microseconds. vLLM's CPU backend ships the
// same ops (rms_norm, fused_add_rms_norm, rotary_embedding) for the same reason. They run on the
// calling thread: the work is smaller than a thread wake-up.
#include <cmath>
#include <cstdint>

#include "layer_ops.h"

namespace pm {

namespace {

// Independent partial sums of a row's squares: one running sum is a chain of dependent double
// adds (a few cycles each, many times the rest of the norm); kSumLanes of them, each over every kSumLanes-th element and added in a fixed order
// at the end, run side by side. The order is this source's, not the vector width's: no
// -ffast-math here, so the compiler keeps each chain as written and the bits do not depend on it.
constexpr int64_t kSumLanes = 8;

// out[i] = x[i] / rms(x) * weight[i] over one row; the sum of squares is accumulated in double.
void norm_row(const float* x, const float* weight, float* out, int64_t hidden, float eps) {
  double partial[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= hidden; i += kSumLanes)
    for (int64_t j = 0; j < kSumLanes; ++j)
      partial[j] += static_cast<double>(x[i + j]) * x[i + j];
  for (; i < hidden; ++i) partial[i % kSumLanes] += static_cast<double>(x[i]) * x[i];
  double sum_sq = 0.0;
  for (int64_t j = 0; j < kSumLanes; ++j) sum_sq += partial[j];
  const float inv_rms = static_cast<float>(1.0 / std::sqrt(sum_sq / hidden + eps));
  for (i = 0; i < hidden; ++i) out[i] = weight[i] * (x[i] * inv_rms);
}

}  // namespace

void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t hidden,
              float eps) {
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * hidden, weight, out + r * hidden, hidden, eps);
}

void add_rms_norm(const float* x, const float* y, const float* weight, float* sum, float* normed,
                  int64_t rows, int64_t hidden, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = x + r * hidden;
    const float* b = y + r * hidden;
    float* s = sum + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) s[i] = a[i] + b[i];
    norm_row(s, weight, normed + r * hidden, hidden, eps);
  }
}

void rotary_inplace(float* rows, int64_t num_rows, int64_t row_stride, int64_t num_heads,
                    int64_t head_dim, const int64_t* positions, const float* cos_table,
                    const float* sin_table) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* c = cos_table + positions[r] * head_dim;
    const float* s = sin_table + positions[r] * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
      float* x = rows + r * row_stride + h * head_dim;
      // rotate_half(x) = [-x2, x1]: out1 = x1*cos1 - x2*sin1, out2 = x2*cos2 + x1*sin2.
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

}  // namespace pm
