#include "common/util.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <stdexcept>

namespace speedmla::test {

std::mt19937_64 case_rng(std::string_view case_name) {
  const uint64_t seed = test_seed();
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(std::hash<std::string_view>{}(case_name))};
  return std::mt19937_64(seq);
}

bool has_gpu() {
  static const bool available = [] {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  }();
  return available;
}

namespace {

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

}  // namespace

HostTensor::HostTensor(DType dtype, std::initializer_list<int64_t> shape)
    : HostTensor(dtype, std::vector<int64_t>(shape)) {}

HostTensor::HostTensor(DType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  bytes_.assign(static_cast<size_t>(n) * dtype_size(dtype), 0);
  view_ = make_view(bytes_.data(), dtype, Device{}, shape);
}

DeviceTensor::DeviceTensor(const HostTensor& host)
    : DeviceTensor(host.view().dtype,
                   std::vector<int64_t>(host.view().shape.begin(),
                                        host.view().shape.begin() + host.view().ndim)) {
  upload(host);
}

DeviceTensor::DeviceTensor(DType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  nbytes_ = static_cast<size_t>(n) * dtype_size(dtype);
  if (nbytes_) cuda_check(cudaMalloc(&ptr_, nbytes_), "cudaMalloc");
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  view_ = make_view(ptr_, dtype, Device{DeviceKind::kCUDA, device}, shape);
}

DeviceTensor::~DeviceTensor() {
  if (ptr_) cudaFree(ptr_);
}

DeviceTensor::DeviceTensor(DeviceTensor&& other) noexcept { *this = std::move(other); }

DeviceTensor& DeviceTensor::operator=(DeviceTensor&& other) noexcept {
  if (this != &other) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = other.ptr_;
    nbytes_ = other.nbytes_;
    view_ = other.view_;
    other.ptr_ = nullptr;
    other.nbytes_ = 0;
  }
  return *this;
}

void DeviceTensor::upload(const HostTensor& host) {
  if (host.nbytes() != nbytes_) throw std::runtime_error("DeviceTensor::upload: size mismatch");
  if (nbytes_) cuda_check(cudaMemcpy(ptr_, host.view().data, nbytes_, cudaMemcpyHostToDevice), "upload");
}

void DeviceTensor::download(HostTensor& host) const {
  if (host.nbytes() != nbytes_) throw std::runtime_error("DeviceTensor::download: size mismatch");
  if (nbytes_) cuda_check(cudaMemcpy(host.view().data, ptr_, nbytes_, cudaMemcpyDeviceToHost), "download");
}

HostTensor DeviceTensor::to_host() const {
  HostTensor host(view_.dtype, std::vector<int64_t>(view_.shape.begin(), view_.shape.begin() + view_.ndim));
  download(host);
  return host;
}

void DeviceTensor::fill_bytes(uint8_t byte) {
  if (nbytes_) cuda_check(cudaMemset(ptr_, byte, nbytes_), "cudaMemset");
}

namespace {

size_t checked_bytes(const TensorView& device, const HostTensor& host, const char* what) {
  const size_t bytes = static_cast<size_t>(device.numel()) * dtype_size(device.dtype);
  if (!device.is_contiguous() || bytes != host.nbytes())
    throw std::runtime_error(std::string(what) + ": the device view must be contiguous and as large as the host tensor");
  return bytes;
}

}  // namespace

void copy_from_device(const TensorView& device, HostTensor& host) {
  const size_t bytes = checked_bytes(device, host, "copy_from_device");
  if (bytes) cuda_check(cudaMemcpy(host.view().data, device.data, bytes, cudaMemcpyDeviceToHost), "copy_from_device");
}

void copy_to_device(const HostTensor& host, const TensorView& device) {
  const size_t bytes = checked_bytes(device, host, "copy_to_device");
  if (bytes) cuda_check(cudaMemcpy(device.data, host.view().data, bytes, cudaMemcpyHostToDevice), "copy_to_device");
}

double get(const HostTensor& t, int64_t i) {
  switch (t.view().dtype) {
    case DType::kFloat8E4M3: return fp8_e4m3_to_float(t.data<uint8_t>()[i]);
    case DType::kBFloat16: return bf16_to_float(t.data<uint16_t>()[i]);
    case DType::kFloat16: return fp16_to_float(t.data<uint16_t>()[i]);
    case DType::kFloat32: return t.data<float>()[i];
    case DType::kInt32: return t.data<int32_t>()[i];
    case DType::kInt64: return static_cast<double>(t.data<int64_t>()[i]);
    case DType::kUInt8: return t.data<uint8_t>()[i];
  }
  return 0;
}

void set(HostTensor& t, int64_t i, double value) {
  const float f = static_cast<float>(value);
  switch (t.view().dtype) {
    case DType::kFloat8E4M3: t.data<uint8_t>()[i] = float_to_fp8_e4m3(f); break;
    case DType::kBFloat16: t.data<uint16_t>()[i] = float_to_bf16(f); break;
    case DType::kFloat16: t.data<uint16_t>()[i] = float_to_fp16(f); break;
    case DType::kFloat32: t.data<float>()[i] = f; break;
    case DType::kInt32: t.data<int32_t>()[i] = static_cast<int32_t>(value); break;
    case DType::kInt64: t.data<int64_t>()[i] = static_cast<int64_t>(value); break;
    case DType::kUInt8: t.data<uint8_t>()[i] = static_cast<uint8_t>(value); break;
  }
}

void fill_uniform(HostTensor& t, std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) set(t, i, dist(rng));
}

void fill_bytes(HostTensor& t, uint8_t byte) {
  std::memset(t.view().data, byte, t.nbytes());
}

std::string ErrorStats::summary() const {
  std::ostringstream os;
  os << "rel_l2=" << rel_l2 << " max_abs=" << max_abs << " nonfinite=" << nonfinite
     << " mismatched_inf=" << mismatched_inf;
  return os.str();
}

namespace {

// Elements [begin, end) of both tensors (flat, row-major).
ErrorStats compare_elements(const HostTensor& actual, const HostTensor& expected, int64_t begin, int64_t end) {
  ErrorStats s;
  double diff2 = 0, ref2 = 0;
  for (int64_t i = begin; i < end; ++i) {
    const double a = get(actual, i), b = get(expected, i);
    if (std::isinf(b) || std::isinf(a)) {
      if (a != b) ++s.mismatched_inf;
      continue;
    }
    if (!std::isfinite(a) && std::isfinite(b)) { ++s.nonfinite; continue; }
    if (std::isnan(b)) { if (!std::isnan(a)) ++s.nonfinite; continue; }
    diff2 += (a - b) * (a - b);
    ref2 += b * b;
    s.max_abs = std::max(s.max_abs, std::abs(a - b));
  }
  s.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  return s;
}

}  // namespace

ErrorStats compare(const HostTensor& actual, const HostTensor& expected) {
  if (actual.numel() != expected.numel()) throw std::runtime_error("compare: element counts differ");
  return compare_elements(actual, expected, 0, actual.numel());
}

ErrorStats compare(const HostTensor& actual, const HostTensor& expected, int64_t begin, int64_t end) {
  if (begin < 0 || end < begin || end > actual.numel() || end > expected.numel())
    throw std::runtime_error("compare: range outside the tensors");
  return compare_elements(actual, expected, begin, end);
}

ErrorStats compare_rows(const HostTensor& actual, const HostTensor& expected, int64_t row_begin, int64_t row_end) {
  if (actual.numel() != expected.numel()) throw std::runtime_error("compare_rows: element counts differ");
  const TensorView& v = expected.view();
  const int64_t rows = v.ndim > 0 ? v.shape[0] : 1;
  if (row_begin < 0 || row_begin > row_end || row_end > rows) throw std::out_of_range("compare_rows: bad row range");
  const int64_t row_elements = rows > 0 ? expected.numel() / rows : 0;
  return compare_elements(actual, expected, row_begin * row_elements, row_end * row_elements);
}

uint64_t test_seed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("SPEEDMLA_TEST_SEED"); env != nullptr && *env != '\0')
      return static_cast<uint64_t>(std::strtoull(env, nullptr, 10));
    return static_cast<uint64_t>(std::random_device{}() % 1000000);
  }();
  const testing::TestInfo* test = testing::UnitTest::GetInstance()->current_test_info();
  std::printf("[   seed   ] %s.%s: SPEEDMLA_TEST_SEED=%llu\n", test ? test->test_suite_name() : "?",
              test ? test->name() : "?", static_cast<unsigned long long>(seed));
  return seed;
}

}  // namespace speedmla::test
