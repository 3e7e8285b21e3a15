#include "reference/element.h"

#include <bit>
#include <cmath>

#include "speedmla/numeric.h"

namespace speedmla::reference {
namespace {

// `value` rounded to float with round-to-odd: an inexact result is the neighbour (of the two
// around `value`) whose last mantissa bit is 1. Rounding that float to nearest even into any
// format at least two bits narrower gives the same result as rounding `value` directly, so the
// double results of the reference are rounded once, not twice, into BF16, FP16 and FP8.
float to_float_round_odd(double value) {
  float nearest = static_cast<float>(value);
  if (static_cast<double>(nearest) == value || std::isnan(value)) return nearest;
  if (std::abs(static_cast<double>(nearest)) > std::abs(value))
    nearest = std::nextafter(nearest, 0.0f);  // the neighbour towards zero (inf -> FLT_MAX)
  return std::bit_cast<float>(std::bit_cast<uint32_t>(nearest) | 1u);
}

template <typename Raw>
Raw raw(const TensorView& t, int64_t offset) {
  return static_cast<const Raw*>(t.data)[offset];
}

template <typename Raw>
void set_raw(const TensorView& t, int64_t offset, Raw bits) {
  static_cast<Raw*>(t.data)[offset] = bits;
}

}  // namespace

int64_t load_index(const TensorView& t, int64_t offset) {
  return t.dtype == DType::kInt64 ? raw<int64_t>(t, offset) : raw<int32_t>(t, offset);
}

double load(const TensorView& t, int64_t offset) {
  switch (t.dtype) {
    case DType::kFloat8E4M3: return fp8_e4m3_to_float(raw<uint8_t>(t, offset));
    case DType::kBFloat16: return bf16_to_float(raw<uint16_t>(t, offset));
    case DType::kFloat16: return fp16_to_float(raw<uint16_t>(t, offset));
    case DType::kFloat32: return raw<float>(t, offset);
    default: return static_cast<double>(load_index(t, offset));
  }
}

void store(const TensorView& t, int64_t offset, double value) {
  switch (t.dtype) {
    case DType::kFloat8E4M3:
      return set_raw(t, offset, float_to_fp8_e4m3(to_float_round_odd(value)));
    case DType::kBFloat16: return set_raw(t, offset, float_to_bf16(to_float_round_odd(value)));
    case DType::kFloat16: return set_raw(t, offset, float_to_fp16(to_float_round_odd(value)));
    case DType::kFloat32: return set_raw(t, offset, static_cast<float>(value));
    default: return;  // the reference writes no integer tensors
  }
}

void convert(const TensorView& src, int64_t src_offset, const TensorView& dst,
             int64_t dst_offset, float scale) {
  store(dst, dst_offset, static_cast<float>(load(src, src_offset)) * scale);
}

template <typename Dst>
void load_row(const TensorView& t, int64_t offset, int64_t count, Dst* dst) {
  const int64_t step = t.stride(-1);
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<Dst>(load(t, offset + i * step));
}
template void load_row<float>(const TensorView&, int64_t, int64_t, float*);
template void load_row<double>(const TensorView&, int64_t, int64_t, double*);

void store_row(const TensorView& t, int64_t offset, int64_t count, const double* src) {
  const int64_t step = t.stride(-1);
  for (int64_t i = 0; i < count; ++i) store(t, offset + i * step, src[i]);
}

void convert_row(const TensorView& src, int64_t src_offset, const TensorView& dst,
                 int64_t dst_offset, int64_t count, float scale) {
  const int64_t src_step = src.stride(-1), dst_step = dst.stride(-1);
  for (int64_t i = 0; i < count; ++i)
    convert(src, src_offset + i * src_step, dst, dst_offset + i * dst_step, scale);
}

}  // namespace speedmla::reference
