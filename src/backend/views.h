// Re-slicing TensorViews without copying: how the backend hands parts of the engine's tensors
// and of its own buffers to the operations. Callers keep the results in bounds.
#pragma once

#include <cstdint>

#include "speedmla/tensor.h"

namespace speedmla::detail {

// Rows [begin, begin + count) of dimension 0.
inline TensorView slice_rows(const TensorView& t, int64_t begin, int64_t count) {
  TensorView s = t;
  s.data = static_cast<char*>(t.data) + begin * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  s.shape[0] = count;
  return s;
}

// Elements [begin, begin + count) of the last dimension.
inline TensorView slice_last(const TensorView& t, int64_t begin, int64_t count) {
  TensorView s = t;
  const int last = t.ndim - 1;
  s.data = static_cast<char*>(t.data) +
           begin * t.strides[last] * static_cast<int64_t>(dtype_size(t.dtype));
  s.shape[last] = count;
  return s;
}

// Dimension 0 of size outer * inner split into [outer, inner] (one more dimension).
inline TensorView split_rows(const TensorView& t, int64_t outer, int64_t inner) {
  TensorView s = t;
  s.ndim = t.ndim + 1;
  for (int d = t.ndim; d >= 1; --d) {
    s.shape[d] = t.shape[d - 1];
    s.strides[d] = t.strides[d - 1];
  }
  s.shape[0] = outer;
  s.shape[1] = inner;
  s.strides[0] = inner * t.strides[0];
  return s;
}

// Dimension `dim` (of size 1) removed.
inline TensorView squeeze(const TensorView& t, int dim) {
  TensorView s = t;
  s.ndim = t.ndim - 1;
  for (int d = dim; d < s.ndim; ++d) {
    s.shape[d] = t.shape[d + 1];
    s.strides[d] = t.strides[d + 1];
  }
  return s;
}

}  // namespace speedmla::detail
