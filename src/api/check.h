// Argument validation shared by the entry points (src/api/*.cpp). Kernels never validate.
//
// Each check throws speedmla::Error with "<function>: <argument> <what was expected>, got <what
// was seen>", so a caller can fix the call from the message alone.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>

#include "speedmla/error.h"
#include "speedmla/prefill.h"
#include "speedmla/tensor.h"

namespace speedmla::detail {

// Builds a message from streamable parts and throws Error. Out of line and cold: the checks
// that call it inline only their condition.
template <typename... Parts>
[[noreturn, gnu::noinline, gnu::cold]] void fail(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw Error(os.str());
}

// Message parts that cost an allocation to spell out (a shape, a device name): passed to
// require() as these wrappers, they are spelled out only when a check fails. The checks run on
// every call of every operation, so a passing one must not build strings.
struct ShapeOf {
  const TensorView& t;
};
inline ShapeOf shape_of(const TensorView& t) { return {t}; }
std::ostream& operator<<(std::ostream& os, ShapeOf shape);  // "[2, 3, 576]"
struct DeviceOf {
  Device device;
};
inline DeviceOf device_of(Device device) { return {device}; }
std::ostream& operator<<(std::ostream& os, DeviceOf device);  // "cpu", "cuda:1"
// The arguments of a call, "1, 16, 1, 132" (built in the same full expression as the require()
// that prints it, which its initializer list outlives).
struct CallArguments {
  std::initializer_list<int64_t> values;
};
std::ostream& operator<<(std::ostream& os, CallArguments arguments);

// The checker for one call: carries the function name into every message.
class ArgChecker {
 public:
  explicit ArgChecker(const char* function) : fn_(function) {}

  template <typename... Parts>
  [[noreturn]] void fail(const Parts&... parts) const { detail::fail(fn_, ": ", parts...); }

  // Throws "<function>: <parts...>" unless `condition`. The parts are only streamed on failure,
  // but they are evaluated by the caller: pass references, numbers, C strings and the lazy
  // wrappers above (shape_of, device_of), never a std::string built for the message.
  template <typename... Parts>
  void require(bool condition, const Parts&... parts) const {
    if (!condition) [[unlikely]] fail(parts...);
  }

  // data != nullptr and aligned to the element size (unless numel == 0), ndim as given.
  void defined(const TensorView& t, const char* name, int ndim) const;
  // dtype is one of the given ones.
  void dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed) const;
  // shape[dim] == value.
  void dim(const TensorView& t, const char* name, int d, int64_t value) const;
  // stride of the last dim is 1.
  void last_dim_contiguous(const TensorView& t, const char* name) const;
  void contiguous(const TensorView& t, const char* name) const;
  // data pointer and every stride except the last (in bytes) are multiples of `bytes`.
  void aligned(const TensorView& t, const char* name, int64_t bytes) const;
  // `t` lives on `device`.
  void same_device(const TensorView& t, const char* name, Device device) const;
  // No two elements of `t` share an address (an output written in parallel): sorted by size,
  // each stride exceeds the span of the smaller dims. Stride-0 broadcasts and interleavings fail.
  void non_overlapping(const TensorView& t, const char* name) const;
  // The written tensor `t` shares no byte with `other`.
  void disjoint(const TensorView& t, const char* name, const TensorView& other,
                const char* other_name) const;
  // A scalar argument (a scale) is finite.
  void finite(float value, const char* name) const;

  const char* function() const { return fn_; }

 private:
  const char* fn_;
};

// Byte extent [lowest, highest] a view addresses; used for overlap checks.
struct ByteRange {
  uintptr_t begin = 0, end = 0;  // half-open
};
ByteRange byte_range(const TensorView& t);
bool overlaps(const TensorView& a, const TensorView& b);
bool same_view(const TensorView& a, const TensorView& b);  // same data, shape and strides

// Makes `device` current for the scope (no-op for CPU); restores the previous one.
class DeviceGuard {
 public:
  // `function` names the caller in the Error thrown when the device cannot be made current.
  explicit DeviceGuard(Device device, const char* function = "DeviceGuard");
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Throws Error "<function>: CUDA error <name>: <string>" if `status` (a cudaError_t) is not 0.
void check_cuda(int status, const char* function, const char* what);

// For the kernels built for sm_90a (wgmma, setmaxnreg, TMA), which run only on devices of
// compute capability exactly 9.0: throws Error "<function>: <device> has compute capability
// X.Y; ..." for any other CUDA device, or the CUDA error when the capability cannot be read.
// The answer is cached per device (an atomic per device index, no lock), so the check costs a
// load after the first call. CPU devices pass (the CPU reference runs there).
void require_sm90(const ArgChecker& check, Device device);

// Prefill values' layout (prefill.h): true for kFp8Transposed, false for kTokenMajor; Error for
// any other value.
bool values_transposed(const ArgChecker& check, PrefillValueLayout v_layout);
// Values in the kFp8Transposed layout: `name` is [heads, 128, P] with P >= tokens (`tokens_name`
// says what they count) and a multiple of kFp8TransposedGroupTokens.
void check_transposed_values_shape(const ArgChecker& check, const TensorView& t, const char* name, int64_t heads,
                                   int64_t tokens, const char* tokens_name);

}  // namespace speedmla::detail
