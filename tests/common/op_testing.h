// Helpers of the tests of the elementwise operations (cache, merge, quantize): tensors mirrored
// on host and device in strided layouts, bitwise comparison, wide-range random values, and the
// check that a call is refused with a message naming the argument.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/util.h"

namespace speedmla::test {

// A tensor held twice, on the host and on a GPU, in one (possibly strided or offset) layout
// inside a flat storage. Tests fill inputs and expected outputs on the host, run the operation
// on both copies, and compare the whole storages, so that bytes outside the view (gaps between
// strided rows, poisoned beforehand) are checked to stay untouched.
class Mirror {
 public:
  // `strides` empty: contiguous. The view starts `offset` elements into the storage.
  Mirror(DType dtype, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides = {},
         int64_t offset = 0);

  HostTensor host;      // the flat storage on the host
  DeviceTensor device;  // the same bytes on the device once uploaded
  const TensorView& host_view() const { return host_view_; }
  const TensorView& device_view() const { return device_view_; }

  void upload() { device.upload(host); }
  HostTensor download() const { return device.to_host(); }
  void poison();  // 0xFF (NaN for every float dtype) in both storages
  std::string layout() const;  // "bfloat16 [3, 576] strides [600, 1] offset 8"

 private:
  TensorView host_view_, device_view_;
};

// Success when every element of `actual` has the bits of `expected` (two NaNs match whatever
// their payloads: conversions may differ in the NaN they produce); otherwise the number of
// mismatches and the first few, with flat storage index, bits and values.
testing::AssertionResult bitwise_equal(const HostTensor& actual, const HostTensor& expected);

// Fills `t` (a float dtype) with values of either sign spread log-uniformly over 2^-12..2^10,
// so that conversions see subnormal FP8, ordinary values and saturation; about one element in
// 32 is a special case instead (0, -0, ±inf, NaN, ±448, 464, 1e6, FP8 rounding ties).
void fill_wide(HostTensor& t, std::mt19937_64& rng);

// Success when `call` throws speedmla::Error whose message contains every one of `parts`
// (e.g. {"kv_cache_write: latent", "512"}); the message is shown either way.
testing::AssertionResult throws_error(const std::function<void()>& call,
                                      std::initializer_list<std::string_view> parts);

}  // namespace speedmla::test
