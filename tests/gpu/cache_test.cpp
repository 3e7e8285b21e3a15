// kv_cache_write and gather_cache on the GPU against the CPU path (the reference), bit for bit,
// on fresh random data, with every output and the whole cache poisoned beforehand.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/op_testing.h"
#include "common/util.h"
#include "cpu/reference_testing.h"

namespace speedmla::test {
namespace {

constexpr int64_t kPagePad = 64;  // elements between strided pages (64 or 128 bytes: aligned)

struct CacheCase {
  DType dtype;
  int64_t page_size;
};

void PrintTo(const CacheCase& c, std::ostream* os) {
  *os << dtype_name(c.dtype) << " cache, page_size " << c.page_size;
}

std::string case_name(const testing::TestParamInfo<CacheCase>& info) {
  return std::string(dtype_name(info.param.dtype)) + "_page" + std::to_string(info.param.page_size);
}

// A poisoned cache of at least `min_slots` slots; pages kPagePad elements apart when `strided`.
Mirror make_cache(const CacheCase& c, int64_t min_slots, bool strided) {
  const int64_t pages = (min_slots + c.page_size - 1) / c.page_size + 1;
  const int64_t page_stride = c.page_size * kCacheRowDim + (strided ? kPagePad : 0);
  Mirror cache(c.dtype, {pages, c.page_size, kCacheRowDim}, {page_stride, kCacheRowDim, 1});
  cache.poison();
  return cache;
}

// `count` distinct slots of [0, num_slots) in random order; about one in eight replaced by
// padding (negative) and one in sixteen by a slot past the cache. count <= num_slots.
std::vector<int64_t> random_slots(std::mt19937_64& rng, int64_t count, int64_t num_slots) {
  std::vector<int64_t> all(num_slots);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<int64_t> slots(all.begin(), all.begin() + count);
  std::uniform_int_distribution<int> pick(0, 15);
  for (int64_t& slot : slots) {
    const int k = pick(rng);
    if (k < 2) slot = k == 0 ? -1 : -1 - slot;
    if (k == 2) slot = num_slots + slot;
  }
  return slots;
}

Mirror slot_tensor(const std::vector<int64_t>& slots) {
  Mirror t(DType::kInt64, {static_cast<int64_t>(slots.size())});
  std::copy(slots.begin(), slots.end(), t.host.data<int64_t>());
  t.upload();
  return t;
}

void fill_random_bytes(HostTensor& t, std::mt19937_64& rng) {
  auto* bytes = static_cast<uint8_t*>(t.view().data);
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(rng());
}

// A layout of one input or output of the cases below: row stride (0: dense) and offset, in
// elements. An odd stride or offset forces the scalar path.
struct RowLayout {
  int64_t stride = 0, offset = 0;
};

Mirror make_rows(DType dtype, int64_t rows, int64_t width, RowLayout layout) {
  return Mirror(dtype, {rows, width}, {layout.stride ? layout.stride : width, 1}, layout.offset);
}

struct WriteCase {
  int64_t tokens;
  DType latent_dtype, rope_dtype;
  RowLayout latent, rope;
  bool strided_pages;
  float scale_inv;
};

class CacheGpu : public testing::TestWithParam<CacheCase> {};

TEST_P(CacheGpu, WriteMatchesReference) {
  SPEEDMLA_REQUIRE_GPU();
  std::mt19937_64 rng = seeded_rng();
  const CacheCase c = GetParam();
  constexpr DType bf = DType::kBFloat16, f16 = DType::kFloat16, f32 = DType::kFloat32;
  const WriteCase cases[] = {
      {0, bf, bf, {}, {}, false, 1.f},
      {1, bf, bf, {}, {}, false, 1.f},
      {37, bf, bf, {}, {}, true, 0.5f},
      {100, f32, f16, {512 + 16}, {}, true, 1.7f},           // aligned row strides: vector path
      {51, bf, f32, {513}, {64, 1}, false, 1.f},             // odd stride, offset: scalar path
      {200, f16, bf, {}, {68}, true, 0.25f},                 // rope stride 136 bytes: scalar path
  };
  for (const WriteCase& w : cases) {
    Mirror cache = make_cache(c, 2 * w.tokens + 3, w.strided_pages);
    Mirror latent = make_rows(w.latent_dtype, w.tokens, kLatentDim, w.latent);
    Mirror rope = make_rows(w.rope_dtype, w.tokens, kRopeDim, w.rope);
    fill_wide(latent.host, rng);
    fill_wide(rope.host, rng);
    latent.upload();
    rope.upload();
    const Mirror slots = slot_tensor(
        random_slots(rng, w.tokens, cache.host_view().size(0) * cache.host_view().size(1)));
    SCOPED_TRACE(testing::Message() << "T=" << w.tokens << " cache " << cache.layout() << " latent "
                                    << latent.layout() << " rope " << rope.layout()
                                    << " scale_inv " << w.scale_inv);

    kv_cache_write(cache.host_view(), slots.host_view(), latent.host_view(), rope.host_view(),
                   w.scale_inv);
    kv_cache_write(cache.device_view(), slots.device_view(), latent.device_view(),
                   rope.device_view(), w.scale_inv);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(cache.download(), cache.host));
  }
}

struct GatherCase {
  int64_t rows;
  RowLayout out;
  bool strided_pages;
  float scale;
};

TEST_P(CacheGpu, GatherMatchesReference) {
  SPEEDMLA_REQUIRE_GPU();
  std::mt19937_64 rng = seeded_rng();
  const CacheCase c = GetParam();
  const GatherCase cases[] = {
      {0, {}, false, 1.f},
      {1, {}, false, 1.f},
      {33, {}, true, 0.75f},
      {300, {kCacheRowDim + 64}, true, 3.3f},  // strided rows, 16-byte aligned: vector path
      {45, {kCacheRowDim + 1}, false, 1.f},    // odd row stride: scalar path
      {20, {}, true, 2.f},
  };
  for (const GatherCase& g : cases) {
    Mirror cache = make_cache(c, 2 * g.rows + 3, g.strided_pages);
    fill_random_bytes(cache.host, rng);  // every code, NaN and inf included
    cache.upload();
    const int64_t num_slots = cache.host_view().size(0) * cache.host_view().size(1);
    const Mirror slots = slot_tensor(random_slots(rng, g.rows, num_slots));
    Mirror out = make_rows(DType::kBFloat16, g.rows, kCacheRowDim, g.out);
    out.poison();
    SCOPED_TRACE(testing::Message() << "n=" << g.rows << " cache " << cache.layout() << " out "
                                    << out.layout() << " scale " << g.scale);

    gather_cache(cache.host_view(), slots.host_view(), out.host_view(), g.scale);
    gather_cache(cache.device_view(), slots.device_view(), out.device_view(), g.scale);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(out.download(), out.host));
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesAndPageSizes, CacheGpu,
                         testing::Values(CacheCase{DType::kFloat8E4M3, 1}, CacheCase{DType::kFloat8E4M3, 16},
                                         CacheCase{DType::kFloat8E4M3, 64}, CacheCase{DType::kFloat8E4M3, 128},
                                         CacheCase{DType::kBFloat16, 1}, CacheCase{DType::kBFloat16, 16},
                                         CacheCase{DType::kBFloat16, 64}, CacheCase{DType::kBFloat16, 128}),
                         case_name);

// Captured once, replayed with new slots, rows and gather lists uploaded into the same buffers.
TEST(CacheGpuGraph, WriteAndGatherReplayWithNewData) {
  SPEEDMLA_REQUIRE_GPU();
  std::mt19937_64 rng = seeded_rng();
  constexpr int64_t kTokens = 40, kGathered = 64;
  Mirror cache = make_cache({DType::kFloat8E4M3, 16}, 4 * kTokens, /*strided=*/true);
  const int64_t num_slots = cache.host_view().size(0) * cache.host_view().size(1);
  Mirror slots(DType::kInt64, {kTokens}), gather_slots(DType::kInt64, {kGathered});
  Mirror latent(DType::kBFloat16, {kTokens, kLatentDim}), rope(DType::kBFloat16, {kTokens, kRopeDim});
  Mirror out(DType::kBFloat16, {kGathered, kCacheRowDim});
  constexpr float kScaleInv = 0.5f, kScale = 2.f;

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  kv_cache_write(cache.device_view(), slots.device_view(), latent.device_view(), rope.device_view(),
                 kScaleInv, stream);
  gather_cache(cache.device_view(), gather_slots.device_view(), out.device_view(), kScale, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE(testing::Message() << "replay " << replay);
    const std::vector<int64_t> written = random_slots(rng, kTokens, num_slots);
    std::copy(written.begin(), written.end(), slots.host.data<int64_t>());
    // Half of the gathered rows are this replay's slots, the rest any slot, padding or past the end.
    const std::vector<int64_t> others = random_slots(rng, kGathered, num_slots);
    for (int64_t i = 0; i < kGathered; ++i)
      gather_slots.host.data<int64_t>()[i] = i % 2 ? written[i / 2 % kTokens] : others[i];
    fill_wide(latent.host, rng);
    fill_wide(rope.host, rng);
    for (Mirror* t : {&slots, &gather_slots, &latent, &rope}) t->upload();
    out.poison();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // uploads and poison land before the replay

    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    kv_cache_write(cache.host_view(), slots.host_view(), latent.host_view(), rope.host_view(), kScaleInv);
    gather_cache(cache.host_view(), gather_slots.host_view(), out.host_view(), kScale);
    EXPECT_TRUE(bitwise_equal(cache.download(), cache.host));
    EXPECT_TRUE(bitwise_equal(out.download(), out.host));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// A cache view of more than 2^31 elements (2.5 GB of FP8, 5 GB of BF16): writes and gathers past
// element 2^31 must land where 64-bit addressing puts them. The touched rows are compared with a
// small CPU cache holding the same rows at remapped slots; rows next to them must stay poisoned.
class CacheGpuLarge : public testing::TestWithParam<DType> {};

TEST_P(CacheGpuLarge, SlotsBeyondTwoGigaElements) {
  SPEEDMLA_REQUIRE_GPU();
  const DType dtype = GetParam();
  const auto esize = static_cast<int64_t>(dtype_size(dtype));
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  if (free_bytes < (size_t{16} << 30)) GTEST_SKIP() << "needs > 16 GB free, has " << (free_bytes >> 20) << " MB";
  std::mt19937_64 rng = seeded_rng();
  constexpr int64_t kPageSize = 64, kPages = 67817;  // 67817 * 64 * 576 = 2.50e9 elements
  constexpr int64_t kSlots = kPages * kPageSize, kBoundary = (int64_t{1} << 31) / kCacheRowDim;
  DeviceTensor cache(dtype, {kPages, kPageSize, kCacheRowDim});
  cache.fill_bytes(0xFF);

  // Slots around element 2^31, at the very end, near the start; padding and past-the-end ones.
  std::vector<int64_t> slots = {kBoundary - 1, kBoundary, kBoundary + 1, kBoundary + 777,
                                kSlots - 1,    kSlots - 2, kSlots - kPageSize, 5,
                                -1,            kSlots,     kSlots + (int64_t{1} << 40), kSlots / 2};
  const auto tokens = static_cast<int64_t>(slots.size());
  Mirror slot_t = slot_tensor(slots);
  Mirror latent(DType::kBFloat16, {tokens, kLatentDim}), rope(DType::kBFloat16, {tokens, kRopeDim});
  fill_wide(latent.host, rng);
  fill_wide(rope.host, rng);
  latent.upload();
  rope.upload();
  Mirror out(DType::kBFloat16, {tokens, kCacheRowDim});
  out.poison();
  kv_cache_write(cache.view(), slot_t.device_view(), latent.device_view(), rope.device_view(), 1.f);
  gather_cache(cache.view(), slot_t.device_view(), out.device_view(), 1.f);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // The CPU twin: token i at slot i of a one-row-per-page cache; padding and past-the-end kept.
  HostTensor small(dtype, {tokens, 1, kCacheRowDim});
  fill_bytes(small, 0xFF);
  HostTensor small_slots(DType::kInt64, {tokens});
  for (int64_t i = 0; i < tokens; ++i)
    small_slots.data<int64_t>()[i] = slots[i] < 0 ? -1 : slots[i] >= kSlots ? tokens : i;
  kv_cache_write(small.view(), small_slots.view(), latent.host_view(), rope.host_view(), 1.f);
  gather_cache(small.view(), small_slots.view(), out.host_view(), 1.f);
  EXPECT_TRUE(bitwise_equal(out.download(), out.host));

  const auto* base = static_cast<const uint8_t*>(cache.view().data);
  const int64_t row_bytes = kCacheRowDim * esize;
  std::vector<uint8_t> row(row_bytes);
  for (int64_t i = 0; i < tokens; ++i) {
    if (slots[i] < 0 || slots[i] >= kSlots) continue;
    SCOPED_TRACE(testing::Message() << "slot " << slots[i]);
    // Element-wise as everywhere else (bitwise_equal): NaN payloads may differ between the CPU's
    // and the GPU's conversions (BF16), any NaN matches any NaN.
    HostTensor got(dtype, {kCacheRowDim}), want(dtype, {kCacheRowDim});
    ASSERT_EQ(cudaMemcpy(got.view().data, base + slots[i] * row_bytes, row_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    std::memcpy(want.view().data, small.data<uint8_t>() + i * row_bytes, row_bytes);
    EXPECT_TRUE(bitwise_equal(got, want));
    for (const int64_t neighbour : {slots[i] - 1, slots[i] + 1}) {
      if (neighbour < 0 || neighbour >= kSlots ||
          std::find(slots.begin(), slots.end(), neighbour) != slots.end())
        continue;
      ASSERT_EQ(cudaMemcpy(row.data(), base + neighbour * row_bytes, row_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_TRUE(std::all_of(row.begin(), row.end(), [](uint8_t b) { return b == 0xFF; }))
          << "neighbour slot " << neighbour << " was written";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CacheGpuLarge, testing::Values(DType::kFloat8E4M3, DType::kBFloat16),
                         DtypeParamName());

}  // namespace
}  // namespace speedmla::test
