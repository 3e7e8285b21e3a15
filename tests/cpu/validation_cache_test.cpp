// kv_cache_write and gather_cache refuse every bad argument with an Error that names it; good CPU
// arguments run the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "common/op_testing.h"
#include "common/util.h"
#include "speedmla/cache.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr Device kCuda{DeviceKind::kCUDA, 0};

// A valid call: 4 pages of 16 slots, three tokens (one of them padding). Tests break one thing.
class CacheValidation : public testing::Test {
 protected:
  CacheValidation() {
    std::mt19937_64 rng(11);
    fill_uniform(latent_, rng, -1.0, 1.0);
    fill_uniform(rope_, rng, -1.0, 1.0);
    const int64_t slots[] = {0, 17, -1};
    std::memcpy(slots_.data<int64_t>(), slots, sizeof slots);
  }

  void write() { kv_cache_write(kv_cache, slots, latent, rope, scale); }
  void gather() { gather_cache(kv_cache, slots, out, scale); }

  HostTensor cache_{DType::kFloat8E4M3, {4, 16, 576}}, slots_{DType::kInt64, {3}},
      latent_{DType::kBFloat16, {3, 512}}, rope_{DType::kBFloat16, {3, 64}},
      out_{DType::kBFloat16, {3, 576}};
  TensorView kv_cache = cache_.view(), slots = slots_.view(), latent = latent_.view(),
             rope = rope_.view(), out = out_.view();
  float scale = 1.0f;
};

TEST_F(CacheValidation, ValidCpuArgumentsRunTheReference) {
  ASSERT_NO_THROW(write());
  HostTensor expected(DType::kFloat8E4M3, {4, 16, 576});
  reference::kv_cache_write(expected.view(), slots, latent, rope, scale);
  EXPECT_TRUE(bitwise_equal(cache_, expected));

  ASSERT_NO_THROW(gather());
  HostTensor expected_out(DType::kBFloat16, {3, 576});
  reference::gather_cache(kv_cache, slots, expected_out.view(), scale);
  EXPECT_TRUE(bitwise_equal(out_, expected_out));
}

TEST_F(CacheValidation, CacheRankDtypeAndRowWidth) {
  TensorView flat = kv_cache;
  flat.ndim = 2;
  EXPECT_TRUE(throws_error([&] { kv_cache_write(flat, slots, latent, rope); },
                           {"kv_cache_write: kv_cache must have 3 dimensions"}));
  kv_cache.dtype = DType::kFloat32;
  EXPECT_TRUE(throws_error([&] { write(); }, {"kv_cache_write: kv_cache must be float8_e4m3fn or bfloat16"}));
  kv_cache.dtype = DType::kFloat8E4M3;
  kv_cache.shape[2] = 512;
  EXPECT_TRUE(throws_error([&] { gather(); }, {"gather_cache: kv_cache.shape[2] must be 576"}));
}

TEST_F(CacheValidation, PageSizeAndPageLayout) {
  TensorView empty_pages = kv_cache;
  empty_pages.shape[1] = 0;
  EXPECT_TRUE(throws_error([&] { kv_cache_write(empty_pages, slots, latent, rope); },
                           {"kv_cache_write: kv_cache.shape[1] (page_size) must be >= 1"}));
  TensorView gappy_rows = kv_cache;
  gappy_rows.shape = {2, 16, 576};
  gappy_rows.strides = {16 * 600, 600, 1};
  EXPECT_TRUE(throws_error([&] { kv_cache_write(gappy_rows, slots, latent, rope); },
                           {"kv_cache_write: kv_cache rows must be contiguous", "stride(1)"}));
  TensorView overlapping_pages = kv_cache;
  overlapping_pages.strides[0] = 8 * 576;
  EXPECT_TRUE(throws_error([&] { gather_cache(overlapping_pages, slots, out); },
                           {"gather_cache: kv_cache.stride(0) (the page stride) must be >= page_size * 576"}));
  TensorView last_dim_strided = kv_cache;
  last_dim_strided.strides[2] = 2;
  EXPECT_TRUE(throws_error([&] { gather_cache(last_dim_strided, slots, out); },
                           {"gather_cache: kv_cache must be contiguous in its last dimension"}));
}

TEST_F(CacheValidation, CacheAlignment) {
  TensorView shifted = kv_cache;
  shifted.shape[0] = 3;
  shifted.data = static_cast<char*>(kv_cache.data) + 1;
  EXPECT_TRUE(throws_error([&] { kv_cache_write(shifted, slots, latent, rope); },
                           {"kv_cache_write: kv_cache data must be 16-byte aligned"}));
  TensorView odd_pages = kv_cache;
  odd_pages.shape[0] = 3;
  odd_pages.strides[0] = 16 * 576 + 8;  // 8 bytes of FP8 between pages
  EXPECT_TRUE(throws_error([&] { kv_cache_write(odd_pages, slots, latent, rope); },
                           {"kv_cache_write: kv_cache.stride(0) must be a multiple of 16 bytes"}));
}

TEST_F(CacheValidation, Slots) {
  TensorView narrow = slots;
  narrow.dtype = DType::kInt32;
  EXPECT_TRUE(throws_error([&] { kv_cache_write(kv_cache, narrow, latent, rope); },
                           {"kv_cache_write: slots must be int64"}));
  TensorView matrix = slots;
  matrix.ndim = 2;
  matrix.shape[1] = 1;
  EXPECT_TRUE(throws_error([&] { gather_cache(kv_cache, matrix, out); },
                           {"gather_cache: slots must have 1 dimensions"}));
  slots.data = nullptr;
  EXPECT_TRUE(throws_error([&] { write(); }, {"kv_cache_write: slots has a null data pointer"}));
}

TEST_F(CacheValidation, InputShapesAndDtypes) {
  latent.shape[1] = 511;
  EXPECT_TRUE(throws_error([&] { write(); }, {"kv_cache_write: latent.shape[1] must be 512"}));
  latent.shape[1] = 512;
  latent.shape[0] = 2;
  EXPECT_TRUE(throws_error([&] { write(); }, {"kv_cache_write: latent.shape[0] must be 3"}));
  latent.shape[0] = 3;
  rope.dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(throws_error([&] { write(); }, {"kv_cache_write: rope must be bfloat16 or float16 or float32"}));
  rope.dtype = DType::kBFloat16;
  rope.shape[1] = 128;
  EXPECT_TRUE(throws_error([&] { write(); }, {"kv_cache_write: rope.shape[1] must be 64"}));
}

TEST_F(CacheValidation, InputLastDimContiguous) {
  latent.strides[1] = 2;  // never read: validation throws first
  EXPECT_TRUE(throws_error([&] { write(); }, {"kv_cache_write: latent must be contiguous in its last dimension"}));
}

TEST_F(CacheValidation, Devices) {
  TensorView gpu_latent = latent;
  gpu_latent.device = kCuda;
  gpu_latent.data = reinterpret_cast<void*>(0x1000);  // never touched: validation throws first
  EXPECT_TRUE(throws_error([&] { kv_cache_write(kv_cache, slots, gpu_latent, rope); },
                           {"kv_cache_write: latent must be on cpu, got cuda:0"}));
  TensorView gpu_cache = kv_cache;
  gpu_cache.device = kCuda;
  EXPECT_TRUE(throws_error([&] { gather_cache(gpu_cache, slots, out); },
                           {"gather_cache: slots must be on cuda:0, got cpu"}));
}

TEST_F(CacheValidation, Overlaps) {
  TensorView latent_in_cache = latent;  // the latent rows inside the cache's own bytes
  latent_in_cache.dtype = DType::kBFloat16;
  latent_in_cache.data = kv_cache.data;
  EXPECT_TRUE(throws_error([&] { kv_cache_write(kv_cache, slots, latent_in_cache, rope); },
                           {"kv_cache_write: kv_cache must not overlap latent"}));
  TensorView out_in_cache = out;
  out_in_cache.data = static_cast<char*>(kv_cache.data) + 1024;
  EXPECT_TRUE(throws_error([&] { gather_cache(kv_cache, slots, out_in_cache); },
                           {"gather_cache: out must not overlap kv_cache"}));
  TensorView slots_in_out = slots;
  slots_in_out.data = out.data;
  EXPECT_TRUE(throws_error([&] { gather_cache(kv_cache, slots_in_out, out); },
                           {"gather_cache: out must not overlap slots"}));
}

TEST_F(CacheValidation, GatherOutput) {
  TensorView wide = out;
  wide.dtype = DType::kFloat32;
  EXPECT_TRUE(throws_error([&] { gather_cache(kv_cache, slots, wide); }, {"gather_cache: out must be bfloat16"}));
  TensorView latent_only = out;
  latent_only.shape[1] = 512;
  EXPECT_TRUE(throws_error([&] { gather_cache(kv_cache, slots, latent_only); },
                           {"gather_cache: out.shape[1] must be 576"}));
  TensorView broadcast = out;
  broadcast.strides[0] = 0;  // every row at one address
  EXPECT_TRUE(throws_error([&] { gather_cache(kv_cache, slots, broadcast); },
                           {"gather_cache: out is written, so no two of its elements may share an address"}));
}

TEST_F(CacheValidation, Scales) {
  scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(throws_error([&] { write(); }, {"kv_cache_write: scale_inv must be finite"}));
  scale = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_error([&] { gather(); }, {"gather_cache: scale must be finite"}));
}

}  // namespace
}  // namespace speedmla::test
