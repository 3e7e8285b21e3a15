#include "common/op_testing.h"

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace speedmla::test {

Mirror::Mirror(DType dtype, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
               int64_t offset) {
  if (!strides.empty() && strides.size() != shape.size())
    throw std::invalid_argument("Mirror: strides and shape differ in rank");
  TensorView view;
  view.dtype = dtype;
  view.ndim = static_cast<int>(shape.size());
  int64_t contiguous = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.shape[d] = shape[d];
    view.strides[d] = strides.empty() ? contiguous : strides[d];
    contiguous *= shape[d];
  }
  int64_t storage = view.numel() == 0 ? 0 : offset + 1;
  for (int d = 0; d < view.ndim && storage > 0; ++d) {
    if (view.strides[d] < 0) throw std::invalid_argument("Mirror: negative stride");
    storage += (view.shape[d] - 1) * view.strides[d];
  }
  host = HostTensor(dtype, {storage});
  device = DeviceTensor(dtype, {storage});
  host_view_ = device_view_ = view;
  const int64_t offset_bytes = storage > 0 ? offset * static_cast<int64_t>(dtype_size(dtype)) : 0;
  host_view_.data = static_cast<char*>(host.view().data) + offset_bytes;
  device_view_.data = static_cast<char*>(device.view().data) + offset_bytes;
  device_view_.device = device.view().device;
}

void Mirror::poison() {
  fill_bytes(host, 0xFF);
  device.fill_bytes(0xFF);
}

std::string Mirror::layout() const {
  std::ostringstream os;
  os << dtype_name(host_view_.dtype) << ' ' << host_view_.shape_string() << " strides [";
  for (int d = 0; d < host_view_.ndim; ++d) os << (d ? ", " : "") << host_view_.strides[d];
  os << "] offset "
     << (static_cast<char*>(host_view_.data) - static_cast<char*>(host.view().data)) /
            static_cast<int64_t>(dtype_size(host_view_.dtype));
  return os.str();
}

testing::AssertionResult bitwise_equal(const HostTensor& actual, const HostTensor& expected) {
  if (actual.nbytes() != expected.nbytes() || actual.view().dtype != expected.view().dtype)
    return testing::AssertionFailure() << "the tensors differ in dtype or size";
  const size_t element = dtype_size(actual.view().dtype);
  const auto* a = static_cast<const uint8_t*>(actual.view().data);
  const auto* e = static_cast<const uint8_t*>(expected.view().data);
  std::ostringstream first;
  int64_t mismatches = 0;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    if (std::memcmp(a + i * element, e + i * element, element) == 0) continue;
    const double va = get(actual, i), ve = get(expected, i);
    if (std::isnan(va) && std::isnan(ve)) continue;
    if (++mismatches > 5) continue;
    uint64_t bits_a = 0, bits_e = 0;
    std::memcpy(&bits_a, a + i * element, element);
    std::memcpy(&bits_e, e + i * element, element);
    first << "\n  [" << i << "] got 0x" << std::hex << bits_a << " (" << std::dec << va
          << "), expected 0x" << std::hex << bits_e << " (" << std::dec << ve << ")";
  }
  if (mismatches == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << mismatches << " of " << actual.numel()
                                     << " elements differ; the first (flat storage index):"
                                     << first.str();
}

void fill_wide(HostTensor& t, std::mt19937_64& rng) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  static constexpr double kSpecial[] = {
      0.0, -0.0, kInf, -kInf, std::numeric_limits<double>::quiet_NaN(), 448.0, -448.0,
      464.0,           // halfway between 448 and the next e4m3 step: rounds to even, saturates
      1e6,             // far past the FP8 range: saturates to 448
      0x1p-10,         // half the smallest FP8 subnormal (2^-9): a tie, rounds to 0
      3 * 0x1p-10,     // 1.5 subnormal steps: a tie, rounds to the even 2^-8
      1.0625, -1.1875  // FP8 ties between normal neighbours (3 mantissa bits)
  };
  std::uniform_real_distribution<double> exponent(-12.0, 10.0);
  std::uniform_int_distribution<int> pick(0, 31 + static_cast<int>(std::size(kSpecial)));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int k = pick(rng);
    if (k > 31) {
      set(t, i, kSpecial[k - 32]);
    } else {
      set(t, i, (k % 2 ? -1.0 : 1.0) * std::exp2(exponent(rng)));
    }
  }
}

testing::AssertionResult throws_error(const std::function<void()>& call,
                                      std::initializer_list<std::string_view> parts) {
  try {
    call();
  } catch (const Error& e) {
    const std::string_view message = e.what();
    for (std::string_view part : parts)
      if (message.find(part) == std::string_view::npos)
        return testing::AssertionFailure() << "message lacks \"" << part << "\": " << message;
    return testing::AssertionSuccess() << message;
  }
  return testing::AssertionFailure() << "no speedmla::Error thrown";
}

}  // namespace speedmla::test
