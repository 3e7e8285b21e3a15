// Test utilities shared by the CPU and GPU tests: owning host/device tensors, random fills,
// poisoning, conversions to double and error metrics.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "speedmla/speedmla.h"

namespace speedmla::test {

// A generator for one named case, seeded from test_seed() and the name: a case draws the same
// data whichever other cases run before it (a --gtest_filter replay included).
std::mt19937_64 case_rng(std::string_view case_name);

// True when a CUDA device is usable; GPU tests GTEST_SKIP() otherwise.
bool has_gpu();
#define SPEEDMLA_REQUIRE_GPU() \
  do { if (!::speedmla::test::has_gpu()) GTEST_SKIP() << "no CUDA device"; } while (0)

// An owning contiguous host tensor.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<int64_t> shape);
  HostTensor(DType dtype, const std::vector<int64_t>& shape);
  // Copies own their bytes: the view follows the data.
  HostTensor(const HostTensor& other) : bytes_(other.bytes_), view_(other.view_) { view_.data = bytes_.data(); }
  HostTensor& operator=(const HostTensor& other) {
    bytes_ = other.bytes_;
    view_ = other.view_;
    view_.data = bytes_.data();
    return *this;
  }
  HostTensor(HostTensor&&) noexcept = default;  // a moved vector keeps its buffer
  HostTensor& operator=(HostTensor&&) noexcept = default;
  const TensorView& view() const { return view_; }
  TensorView& view() { return view_; }
  template <typename T> T* data() { return reinterpret_cast<T*>(bytes_.data()); }
  template <typename T> const T* data() const { return reinterpret_cast<const T*>(bytes_.data()); }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return bytes_.size(); }

 private:
  std::vector<uint8_t> bytes_;
  TensorView view_;
};

// An owning device allocation with a view; copies to and from a HostTensor of the same layout.
class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& host);  // allocates and uploads
  DeviceTensor(DType dtype, const std::vector<int64_t>& shape);
  ~DeviceTensor();
  DeviceTensor(DeviceTensor&& other) noexcept;
  DeviceTensor& operator=(DeviceTensor&& other) noexcept;
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  const TensorView& view() const { return view_; }
  void upload(const HostTensor& host);
  void download(HostTensor& host) const;
  HostTensor to_host() const;
  void fill_bytes(uint8_t byte);  // e.g. 0xFF poisons FP8/BF16/FP32 with NaN

 private:
  void* ptr_ = nullptr;
  size_t nbytes_ = 0;
  TensorView view_;
};

// Copies between a contiguous device view and a host tensor of the same byte size; synchronous
// (they wait for the work queued on the device before them).
void copy_from_device(const TensorView& device, HostTensor& host);
void copy_to_device(const HostTensor& host, const TensorView& device);

// Element i (flat, row-major over a contiguous tensor) as double, and the reverse (rounding
// as the library's conversions do).
double get(const HostTensor& t, int64_t i);
void set(HostTensor& t, int64_t i, double value);

// Uniform random values in [lo, hi), converted to the tensor's dtype.
void fill_uniform(HostTensor& t, std::mt19937_64& rng, double lo, double hi);
// Sets every byte (0xFF = NaN for the float types) — poison before a kernel writes.
void fill_bytes(HostTensor& t, uint8_t byte);

struct ErrorStats {
  double rel_l2 = 0;        // ||a - b|| / ||b||
  double max_abs = 0;       // max |a - b|
  int64_t nonfinite = 0;    // elements of `a` that are NaN/inf where `b` is finite
  int64_t mismatched_inf = 0;  // positions where exactly one of a, b is -inf/+inf
  std::string summary() const;
};
// Compares every element of `actual` with `expected` (same shape, any float dtypes).
ErrorStats compare(const HostTensor& actual, const HostTensor& expected);
// The same over the flat elements [begin, end) of both.
ErrorStats compare(const HostTensor& actual, const HostTensor& expected, int64_t begin, int64_t end);
// The same over rows [row_begin, row_end) of the leading dimension only (e.g. the requests
// [b, b + 1) of a [B, q_len, H, D] output, or the tokens of one request of a ragged [T, H, D]
// one): an aggregate over a whole batch hides one wrong request among thousands. Throws
// std::out_of_range unless 0 <= row_begin <= row_end <= shape[0].
ErrorStats compare_rows(const HostTensor& actual, const HostTensor& expected, int64_t row_begin, int64_t row_end);

// The seed of a test's random data: $SPEEDMLA_TEST_SEED when set, else one drawn once per
// process. Each call prints "[ seed ] <test>: SPEEDMLA_TEST_SEED=<seed>" so that a failing GPU
// run can be replayed with that variable set.
uint64_t test_seed();

// Names GoogleTest instances of a suite parameterised by DType ("float8_e4m3fn", "bfloat16").
struct DtypeParamName {
  template <typename ParamInfo>
  std::string operator()(const ParamInfo& info) const {
    return dtype_name(info.param);
  }
};

}  // namespace speedmla::test
