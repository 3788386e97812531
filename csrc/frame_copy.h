// Strided tensor bytes to and from a dense buffer (frame_copy.cpp).
#pragma once

#include <cstdint>

namespace pm {

constexpr int kMaxFrameDims = 8;

// One tensor's memory: element size in bytes, shape, and strides in elements (any, >= 0).
struct StridedBytes {
  char* data;
  int64_t itemsize;
  int ndim;
  int64_t shape[kMaxFrameDims];
  int64_t strides[kMaxFrameDims];
};

// The tensor's bytes when dense, C order.
int64_t dense_bytes(const StridedBytes& t);
// dst[0 : dense_bytes(t)] = the tensor's elements in C order.
void strided_to_dense(const StridedBytes& t, char* dst);
// The tensor's elements, in C order, = src[0 : dense_bytes(t)].
void dense_to_strided(const char* src, const StridedBytes& t);

}  // namespace pm
