// The check mode (speedmla/check.h) on CPU tensors: each bad device-side value raises its flag,
// good values raise none, flags are cleared when taken, and with the mode off nothing is
// flagged. The GPU kernels share these rules (src/kernels/check/value_checks.h); they are
// tested in tests/gpu/device_values_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/util.h"
#include "cpu/backend_testing.h"
#include "speedmla/speedmla.h"
#include "speedmla/backend.h"

namespace speedmla::test {
namespace {

constexpr Device kCpu{};

class DeviceChecksCpu : public testing::Test {
 protected:
  void SetUp() override {
    set_device_checks(true);
    take_device_check_flags(kCpu);  // nothing left over from another test
  }
  void TearDown() override { set_device_checks(false); }

  // mla_decode of 2 requests (q_len 2, pages of 4, 3 pages per table row, 5 pages) with the
  // given lengths and table; returns the flags it raised.
  uint32_t decode_flags(std::vector<int32_t> lens, std::vector<int32_t> table) {
    HostTensor q(DType::kBFloat16, {2, 2, 1, kCacheRowDim}), cache(DType::kBFloat16, {5, 4, kCacheRowDim});
    HostTensor block_table(DType::kInt32, {2, 3}), seq_lens(DType::kInt32, {2});
    HostTensor out(DType::kBFloat16, {2, 2, 1, kLatentDim});
    std::copy(table.begin(), table.end(), block_table.data<int32_t>());
    std::copy(lens.begin(), lens.end(), seq_lens.data<int32_t>());
    mla_decode(q.view(), cache.view(), block_table.view(), seq_lens.view(), out.view(), std::nullopt, std::nullopt,
               0.1f);
    return take_device_check_flags(kCpu);
  }

  uint32_t slot_flags(std::vector<int64_t> slot_values, bool gather) {
    HostTensor cache(DType::kBFloat16, {3, 2, kCacheRowDim});  // slots [0, 6)
    const auto n = static_cast<int64_t>(slot_values.size());
    HostTensor slots(DType::kInt64, {n});  // written directly: int_tensor goes through double
    std::copy(slot_values.begin(), slot_values.end(), slots.data<int64_t>());
    if (gather) {
      HostTensor out(DType::kBFloat16, {n, kCacheRowDim});
      gather_cache(cache.view(), slots.view(), out.view());
    } else {
      HostTensor latent(DType::kFloat32, {n, kLatentDim}), rope(DType::kFloat32, {n, kRopeDim});
      kv_cache_write(cache.view(), slots.view(), latent.view(), rope.view());
    }
    return take_device_check_flags(kCpu);
  }
};

TEST_F(DeviceChecksCpu, DecodeGoodValuesRaiseNothing) {
  EXPECT_EQ(decode_flags({12, 2}, {1, 2, 3, 4, 0, 0}), 0u);
  // Padding past a request's pages may hold anything: it is never read.
  EXPECT_EQ(decode_flags({5, 4}, {1, 2, -9, 4, 99, 99}), 0u);
}

TEST_F(DeviceChecksCpu, DecodeSeqLenOutOfRange) {
  EXPECT_EQ(decode_flags({13, 2}, {1, 2, 3, 4, 0, 0}), kCheckDecodeSeqLen);  // > 3 pages * 4
  EXPECT_EQ(decode_flags({-1, 2}, {1, 2, 3, 4, 0, 0}), kCheckDecodeSeqLen);
  EXPECT_EQ(decode_flags({std::numeric_limits<int32_t>::min(), 2}, {1, 2, 3, 4, 0, 0}), kCheckDecodeSeqLen);
}

TEST_F(DeviceChecksCpu, DecodePageIdOutOfRange) {
  EXPECT_EQ(decode_flags({12, 2}, {1, 5, 3, 4, 0, 0}), kCheckDecodePageId);  // 5 pages: ids [0, 5)
  EXPECT_EQ(decode_flags({12, 2}, {1, 2, 3, -1, 0, 0}), kCheckDecodePageId);
}

TEST_F(DeviceChecksCpu, DecodeSeqLenBelowQLen) {
  EXPECT_EQ(decode_flags({1, 2}, {1, 2, 3, 4, 0, 0}), kCheckDecodeShortSeq);
  EXPECT_EQ(decode_flags({0, 13}, {1, 2, 3, 4, 0, 0}), kCheckDecodeShortSeq | kCheckDecodeSeqLen);
}

TEST_F(DeviceChecksCpu, CacheSlotsPastTheCache) {
  for (const bool gather : {false, true}) {
    EXPECT_EQ(slot_flags({0, 5, -1, std::numeric_limits<int64_t>::min()}, gather), 0u) << gather;  // negative: padding
    EXPECT_EQ(slot_flags({0, 6}, gather), kCheckCacheSlot) << gather;
    EXPECT_EQ(slot_flags({std::numeric_limits<int64_t>::max()}, gather), kCheckCacheSlot) << gather;
  }
}

TEST_F(DeviceChecksCpu, BackendPoolIndexOutOfRange) {
  MlaBackend backend(small_config());
  const HostTensor req_to_page = numbered_req_to_page(3, 5);
  const HostTensor lens = int_tensor(DType::kInt32, {10, 20});
  auto flags = [&](std::vector<int64_t> pool) {
    const HostTensor indices = int_tensor(DType::kInt64, pool);
    backend.init_forward_metadata(2, 0, indices.view(), lens.view(), ForwardMode::kDecode, req_to_page.view(),
                                  std::nullopt);
    return take_device_check_flags(kCpu);
  };
  EXPECT_EQ(flags({0, 2}), 0u);
  EXPECT_EQ(flags({0, 3}), kCheckPoolIndex);
  EXPECT_EQ(flags({-1, 1}), kCheckPoolIndex);
}

TEST_F(DeviceChecksCpu, FlagsAreClearedWhenTakenAndOffMeansNothing) {
  EXPECT_EQ(decode_flags({13, 2}, {1, 2, 3, 4, 0, 0}), kCheckDecodeSeqLen);
  EXPECT_EQ(take_device_check_flags(kCpu), 0u);
  set_device_checks(false);
  EXPECT_FALSE(device_checks_enabled());
  EXPECT_EQ(decode_flags({13, 2}, {1, 9, 3, 4, 0, 0}), 0u);
}

TEST_F(DeviceChecksCpu, DescribesFlags) {
  EXPECT_EQ(describe_device_check_flags(0), "none");
  EXPECT_EQ(describe_device_check_flags(kCheckDecodeSeqLen | kCheckCacheSlot),
            "decode seq_len out of range, cache slot past the cache");
}

}  // namespace
}  // namespace speedmla::test
