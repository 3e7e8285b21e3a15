// reference::kv_cache_write and reference::gather_cache: element by element against the scalar
// conversions, round trips, and the rules for negative and out-of-range slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "common/util.h"
#include "reference_testing.h"
#include "speedmla/decode.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr uint8_t kPoison = 0x11;  // bytes of cache rows nobody writes

// A cache [num_pages, page_size, 576] whose pages lie `pad` elements apart, poisoned.
struct Cache {
  HostTensor buffer;
  TensorView view;
  Cache(DType dtype, int64_t num_pages, int64_t page_size, int64_t pad)
      : buffer(dtype, {num_pages * (page_size * kCacheRowDim + pad)}) {
    fill_bytes(buffer, kPoison);
    view = buffer.view();
    view.ndim = 3;
    view.shape = {num_pages, page_size, kCacheRowDim};
    view.strides = {page_size * kCacheRowDim + pad, kCacheRowDim, 1};
  }
  int64_t num_slots() const { return view.size(0) * view.size(1); }
  // Element offset of column c of a slot.
  int64_t at(int64_t slot, int64_t c) const {
    return slot / view.size(1) * view.stride(0) + slot % view.size(1) * kCacheRowDim + c;
  }
};

HostTensor int64_tensor(const std::vector<int64_t>& values) {
  HostTensor t(DType::kInt64, {static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.data<int64_t>());
  return t;
}

// The value a written cache element must hold: float(x) * scale_inv, rounded to the cache type.
double stored(DType cache_dtype, double x, float scale_inv) {
  const float product = static_cast<float>(x) * scale_inv;
  return cache_dtype == DType::kFloat8E4M3 ? fp8_e4m3_to_float(float_to_fp8_e4m3(product))
                                           : bf16_to_float(float_to_bf16(product));
}

// Writes T rows at distinct random slots, then checks every element of the cache: written rows
// hold the converted input, all other bytes keep their poison.
void check_write(DType cache_dtype, DType latent_dtype, DType rope_dtype, float scale_inv) {
  std::mt19937_64 rng = seeded_rng();
  Cache cache(cache_dtype, 6, 4, 48);
  std::vector<int64_t> slots(static_cast<size_t>(cache.num_slots()));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(13);
  const auto rows = static_cast<int64_t>(slots.size());
  HostTensor latent(latent_dtype, {rows, kLatentDim}), rope(rope_dtype, {rows, kRopeDim});
  // Large enough that FP8 saturates at ±448 after scaling.
  fill_uniform(latent, rng, -300.0, 300.0);
  fill_uniform(rope, rng, -300.0, 300.0);
  const HostTensor slot_tensor = int64_tensor(slots);
  reference::kv_cache_write(cache.view, slot_tensor.view(), latent.view(), rope.view(), scale_inv);

  const HostTensor poison = [&] {
    HostTensor p(cache_dtype, {1});
    fill_bytes(p, kPoison);
    return p;
  }();
  std::vector<int64_t> row_of_slot(static_cast<size_t>(cache.num_slots()), -1);
  for (int64_t i = 0; i < rows; ++i) row_of_slot[slots[i]] = i;
  ElementChecker check;
  for (int64_t slot = 0; slot < cache.num_slots(); ++slot) {
    const int64_t i = row_of_slot[slot];
    for (int64_t c = 0; c < kCacheRowDim; ++c) {
      const double expected = i < 0 ? get(poison, 0)
                              : c < kLatentDim ? stored(cache_dtype, get(latent, i * kLatentDim + c), scale_inv)
                                               : stored(cache_dtype, get(rope, i * kRopeDim + c - kLatentDim), scale_inv);
      check.same(get(cache.buffer, cache.at(slot, c)), expected, "cache", {slot, c});
    }
  }
}

TEST(ReferenceCache, WriteBf16Cache) { check_write(DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, 1.0f); }

TEST(ReferenceCache, WriteFp8CacheScalesAndSaturates) {
  check_write(DType::kFloat8E4M3, DType::kFloat32, DType::kFloat16, 2.5f);
}

TEST(ReferenceCache, WriteMixedInputsToBf16CacheWithScale) {
  check_write(DType::kBFloat16, DType::kFloat16, DType::kFloat32, 0.75f);
}

TEST(ReferenceCache, NegativeAndOutOfRangeSlotsAreSkipped) {
  std::mt19937_64 rng = seeded_rng();
  Cache cache(DType::kBFloat16, 3, 8, 0);
  const int64_t num_slots = cache.num_slots();
  const HostTensor slots = int64_tensor({-1, num_slots, 5, num_slots + 1000, -(int64_t{1} << 40)});
  HostTensor latent(DType::kBFloat16, {5, kLatentDim}), rope(DType::kBFloat16, {5, kRopeDim});
  fill_uniform(latent, rng, -1.0, 1.0);
  fill_uniform(rope, rng, -1.0, 1.0);
  reference::kv_cache_write(cache.view, slots.view(), latent.view(), rope.view(), 1.0f);
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    for (int64_t c = 0; c < kCacheRowDim; ++c) {
      const uint16_t bits = cache.buffer.data<uint16_t>()[cache.at(slot, c)];
      if (slot != 5) {
        ASSERT_EQ(bits, 0x1111) << "slot " << slot << " was written";
      } else {
        const HostTensor& source = c < kLatentDim ? latent : rope;
        const int64_t col = c < kLatentDim ? c : c - kLatentDim;
        ASSERT_EQ(bits, source.data<uint16_t>()[2 * source.view().size(1) + col]) << c;
      }
    }
  }
}

// Rows written with scale_inv come back with scale: BF16 exactly, FP8 as bf16(fp8 * scale).
TEST(ReferenceCache, GatherReturnsWrittenRowsDequantised) {
  std::mt19937_64 rng = seeded_rng();
  for (DType cache_dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    const bool fp8 = cache_dtype == DType::kFloat8E4M3;
    const float scale_inv = fp8 ? 4.0f : 1.0f, scale = 1.0f / scale_inv;
    Cache cache(cache_dtype, 5, 16, 64);
    const HostTensor slots = int64_tensor({7, 79, 0, 33, 16});
    HostTensor latent(DType::kBFloat16, {5, kLatentDim}), rope(DType::kBFloat16, {5, kRopeDim});
    fill_uniform(latent, rng, -50.0, 50.0);
    fill_uniform(rope, rng, -50.0, 50.0);
    reference::kv_cache_write(cache.view, slots.view(), latent.view(), rope.view(), scale_inv);
    HostTensor out(DType::kBFloat16, {5, kCacheRowDim});
    reference::gather_cache(cache.view, slots.view(), out.view(), scale);
    ElementChecker check;
    for (int64_t i = 0; i < 5; ++i) {
      for (int64_t c = 0; c < kCacheRowDim; ++c) {
        const double x = c < kLatentDim ? get(latent, i * kLatentDim + c)
                                        : get(rope, i * kRopeDim + c - kLatentDim);
        const double expected =
            fp8 ? bf16_to_float(float_to_bf16(static_cast<float>(stored(cache_dtype, x, scale_inv)) * scale))
                : x;
        check.same(get(out, i * kCacheRowDim + c), expected, "out", {i, c});
      }
    }
  }
}

TEST(ReferenceCache, GatherNegativeSlotGivesZerosAndOutOfRangeNaN) {
  Cache cache(DType::kFloat8E4M3, 2, 4, 0);
  const HostTensor slots = int64_tensor({-1, cache.num_slots(), 3});
  HostTensor out(DType::kBFloat16, {3, kCacheRowDim});
  reference::gather_cache(cache.view, slots.view(), out.view(), 1.0f);
  const double poison = fp8_e4m3_to_float(kPoison);
  ElementChecker check;
  for (int64_t c = 0; c < kCacheRowDim; ++c) {
    check.same(get(out, c), 0.0, "out", {0, c});
    check.same(get(out, kCacheRowDim + c), std::numeric_limits<double>::quiet_NaN(), "out", {1, c});
    check.same(get(out, 2 * kCacheRowDim + c), poison, "out", {2, c});
  }
}

}  // namespace
}  // namespace speedmla::test
