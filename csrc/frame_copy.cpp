// Tensor bytes into and out of one message buffer, C order, whatever the tensors' strides: what
// the mesh's inline messages carry (common/transport/ucx_channel.py packs a layer's q/k/v head
// slices into one buffer per shard, and unpacks a shard's reply into place).
//
// NOTE: why C++: the numpy form (a view of each tensor, a typed view of the buffer, a strided
// assignment) costs tens of times the copies themselves in Python and numpy overhead, paid per
// shard per layer per decode step on both sides of the link, and more from the cold caches of a
// process that just woke.
#include "frame_copy.h"

#include <cstring>

namespace pm {

namespace {

// Copies dimensions [dim, ndim) of `shape` from src to dst, each side with its own byte strides;
// a run contiguous on both sides (the innermost dimension, usually) is one memcpy.
void copy_dims(int ndim, const int64_t* shape, int64_t itemsize, const int64_t* src_strides,
               const int64_t* dst_strides, int dim, const char* src, char* dst) {
  const int64_t n = shape[dim];
  if (dim == ndim - 1) {
    if (src_strides[dim] == itemsize && dst_strides[dim] == itemsize) {
      std::memcpy(dst, src, n * itemsize);
      return;
    }
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(dst + i * dst_strides[dim], src + i * src_strides[dim], itemsize);
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    copy_dims(ndim, shape, itemsize, src_strides, dst_strides, dim + 1,
              src + i * src_strides[dim], dst + i * dst_strides[dim]);
}

// C-order byte strides of a dense tensor of `t`'s shape, and `t`'s own strides in bytes.
void byte_strides(const StridedBytes& t, int64_t* dense, int64_t* own) {
  int64_t step = t.itemsize;
  for (int d = t.ndim - 1; d >= 0; --d) {
    dense[d] = step;
    step *= t.shape[d];
    own[d] = t.strides[d] * t.itemsize;
  }
}

}  // namespace

int64_t dense_bytes(const StridedBytes& t) {
  int64_t n = t.itemsize;
  for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
  return n;
}

void strided_to_dense(const StridedBytes& t, char* dst) {
  if (dense_bytes(t) == 0) return;
  if (t.ndim == 0) {
    std::memcpy(dst, t.data, t.itemsize);
    return;
  }
  int64_t dense[kMaxFrameDims], own[kMaxFrameDims];
  byte_strides(t, dense, own);
  copy_dims(t.ndim, t.shape, t.itemsize, own, dense, 0, t.data, dst);
}

void dense_to_strided(const char* src, const StridedBytes& t) {
  if (dense_bytes(t) == 0) return;
  if (t.ndim == 0) {
    std::memcpy(t.data, src, t.itemsize);
    return;
  }
  int64_t dense[kMaxFrameDims], own[kMaxFrameDims];
  byte_strides(t, dense, own);
  copy_dims(t.ndim, t.shape, t.itemsize, dense, own, 0, src, t.data);
}

}  // namespace pm
