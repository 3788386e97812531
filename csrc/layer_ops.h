// Fused elementwise steps of a decoder layer (see layer_ops.cpp); float32, row-major rows.
#pragma once

#include <cstdint>

namespace pm {

// out = x / rms(x) * weight, per row of `hidden` floats.
void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t hidden,
              float eps);

// sum = x + y; normed = sum / rms(sum) * weight (the residual add before a norm, in one pass).
void add_rms_norm(const float* x, const float* y, const float* weight, float* sum, float* normed,
                  int64_t rows, int64_t hidden, float eps);

// Rotates, in place, the first `num_heads` heads of each row (rows `row_stride` floats apart) by
// the row's position: x * cos + rotate_half(x) * sin, with cos/sin tables [max_pos, head_dim].
void rotary_inplace(float* rows, int64_t num_rows, int64_t row_stride, int64_t num_heads,
                    int64_t head_dim, const int64_t* positions, const float* cos_table,
                    const float* sin_table);

}  // namespace pm
