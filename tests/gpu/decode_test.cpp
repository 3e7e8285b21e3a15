// mla_decode on the GPU against the CPU reference, on fresh random data with poisoned outputs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <algorithm>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/captured_graph.h"
#include "common/decode_problem.h"
#include "common/dtype_gpu_test.h"
#include "common/util.h"

namespace speedmla::test {
namespace {


void check_problem(const DecodeProblem& pb) {
  const DecodeResult ref = run_reference(pb);
  DeviceProblem dev(pb);
  dev.out.fill_bytes(0xFF);  // poison: every element must be written
  dev.lse.fill_bytes(0xFF);
  dev.run(pb.spec);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << pb.spec.name();
  expect_matches({dev.out.to_host(), dev.lse.to_host()}, ref, pb.spec);
}

void check_case(const DecodeProblemSpec& spec) { check_problem(make_decode_problem(spec)); }

DecodeProblemSpec spec_for(DType dtype, int64_t batch, int64_t q_len, int64_t heads, int64_t page_size,
                           int32_t len_lo, int32_t len_hi, uint64_t seed) {
  DecodeProblemSpec s;
  s.dtype = dtype;
  s.batch = batch;
  s.q_len = q_len;
  s.heads = heads;
  s.page_size = page_size;
  s.seed = seed;
  std::mt19937_64 rng(seed * 7919 + 17);
  s.seq_lens = random_lengths(rng, batch, len_lo, len_hi);
  return s;
}

class DecodeGpu : public DtypeGpuTest {};

TEST_P(DecodeGpu, HeadsAndDraftLengths) {
  for (int64_t heads : {1, 16, 20, 64, 128})
    for (int64_t q_len : {1, 2, 4})
      check_case(spec_for(dtype(), 3, q_len, heads, 64, 1, 700, seed()));
}

TEST_P(DecodeGpu, LongerVerifyWindows) {
  for (int64_t q_len : {8, 17}) check_case(spec_for(dtype(), 2, q_len, 16, 64, 20, 400, seed()));
  check_case(spec_for(dtype(), 2, 5, 128, 32, 1, 300, seed()));  // 640 rows: 10 row tiles
}

TEST_P(DecodeGpu, PageSizes) {
  for (int64_t page_size : {1, 2, 4, 8, 16, 32, 64, 128})
    check_case(spec_for(dtype(), 4, 2, 16, page_size, 1, 1000, seed()));
}

TEST_P(DecodeGpu, StridedPagesAndPadding) {
  DecodeProblemSpec s = spec_for(dtype(), 5, 2, 32, 32, 1, 500, seed());
  s.page_stride_pad = 3 * kCacheRowDim + 64;  // gaps between pages hold NaN
  s.table_pad_pages = 9;
  s.output_scale = 0.75f;
  check_case(s);
}

// (q_len, heads) pairs of 32 and of 16 query rows (FP8: the narrow kernels of 32 and 16 rows)
// and of 16 rows as four draft tokens of four heads.
constexpr std::pair<int64_t, int64_t> kWideAndNarrowRows[] = {{2, 16}, {1, 16}, {4, 4}};

TEST_P(DecodeGpu, SharpSoftmax) {
  for (const auto& [q_len, heads] : kWideAndNarrowRows) {
    DecodeProblemSpec s = spec_for(dtype(), 4, q_len, heads, 64, 100, 3000, seed());
    s.softmax_scale = 0.5f;  // scores of tens: a few keys dominate, the running max moves
    check_case(s);
  }
}

TEST_P(DecodeGpu, EmptyAndShortRows) {
  // seq_len 0 (no key), seq_len < q_len (early draft tokens see nothing), exactly one block.
  for (int64_t heads : {16, 4}) {
    DecodeProblemSpec s = spec_for(dtype(), 5, 4, heads, 64, 1, 1, seed());
    s.seq_lens = {0, 2, 4, 64, 65};
    check_case(s);
  }
}

TEST_P(DecodeGpu, SplitHeavyLongSequence) {
  check_case(spec_for(dtype(), 1, 1, 16, 64, 262144, 262144, seed()));
}

TEST_P(DecodeGpu, SplitFreeLargeBatch) {
  check_case(spec_for(dtype(), 1024, 1, 16, 64, 1, 256, seed()));
}

TEST_P(DecodeGpu, BatchBeyondThePlannersSharedMemory) {
  // More requests than the schedule kernel keeps in shared memory (kStagedRequests = 4096 in
  // schedule.cu): the plan then weighs part sizes from the first units in global memory.
  check_case(spec_for(dtype(), 5000, 1, 16, 64, 1, 300, seed()));
}

// More requests than the old 65535 limit (the only bound is kMaxDecodeBlocks): 70000 requests
// of one head, short ones sharing the pages of a small problem (as requests sharing a prefix
// do) so the cache stays small, and the last request long enough (> 1/num_parts of the batch's
// blocks) that the plan must split it: the combine then merges a request past index 65535.
TEST_P(DecodeGpu, BatchBeyond65535) {
  constexpr int64_t kBatch = 70000, kBase = 16;
  DecodeProblemSpec base = spec_for(dtype(), kBase, 1, 1, 64, 1, 64, seed());
  base.seq_lens[0] = 60000;  // 938 blocks: more than a part's share of ~71000 blocks on <= 132 parts
  DecodeProblem pb = make_decode_problem(base);  // the cache: base requests' pages
  const int64_t width = pb.block_table.view().shape[1];
  HostTensor table(DType::kInt32, {kBatch, width}), lens(DType::kInt32, {kBatch});
  std::vector<int32_t> seq_lens(kBatch);
  for (int64_t b = 0; b < kBatch; ++b) {
    const int64_t from = b == kBatch - 1 ? 0 : 1 + b % (kBase - 1);  // only the last request is long
    std::copy_n(pb.block_table.data<int32_t>() + from * width, width, table.data<int32_t>() + b * width);
    seq_lens[b] = lens.data<int32_t>()[b] = pb.seq_lens.data<int32_t>()[from];
  }
  pb.spec.batch = kBatch;
  pb.spec.seq_lens = seq_lens;
  pb.block_table = std::move(table);
  pb.seq_lens = std::move(lens);
  pb.q = HostTensor(dtype(), {kBatch, 1, 1, kCacheRowDim});
  std::mt19937_64 rng(pb.spec.seed);
  fill_uniform(pb.q, rng, -1.0, 1.0);
  check_problem(pb);
}

TEST_P(DecodeGpu, EqualLengthsAboutOneRequestPerSm) {
  // The plan keeps whole requests per part here (a part size just above the even split cuts
  // nothing); one shorter request moves every later boundary, and the plan must still hold.
  const int64_t batch = device_sm_count(0) - 4;
  DecodeProblemSpec s = spec_for(dtype(), batch, 1, 16, 64, 2560, 2560, seed());
  check_case(s);
  s.seq_lens[batch / 3] = 2500;
  check_case(s);
}

TEST_P(DecodeGpu, MixedBatchMixedLengths) {
  check_case(spec_for(dtype(), 64, 2, 128, 64, 1, 20000, seed()));
}

TEST_P(DecodeGpu, InvalidSeqLenGivesNaNNotACrash) {
  DecodeProblemSpec s = spec_for(dtype(), 3, 1, 16, 64, 100, 100, seed());
  DecodeProblem pb = make_decode_problem(s);
  const DecodeResult ref = run_reference(pb);
  DeviceProblem dev(pb);
  const int32_t bad[3] = {100, -5, 1 << 30};  // request 1 and 2 are out of range
  ASSERT_EQ(cudaMemcpy(dev.seq_lens.view().data, bad, sizeof(bad), cudaMemcpyHostToDevice), cudaSuccess);
  dev.run(s);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const HostTensor out = dev.out.to_host();
  for (int64_t i = 0; i < kLatentDim * s.heads; ++i) {
    ASSERT_NEAR(get(out, i), get(ref.out, i), 0.05) << i;
    ASSERT_TRUE(std::isnan(get(out, kLatentDim * s.heads + i)));
    ASSERT_TRUE(std::isnan(get(out, 2 * kLatentDim * s.heads + i)));
  }
}

// A NaN in a key that rows see (a corrupted cache row, here in its rope part) makes those rows'
// outputs and LSEs NaN, as the reference's softmax does, whether the request goes out from the
// main kernel or through the combine; the other requests of the batch are unaffected. (An
// all-NaN or partly-NaN score row must not pass for a row that saw no key: LSE -inf, out 0.)
TEST_P(DecodeGpu, NaNKeyPoisonsItsRequestOnly) {
  constexpr std::pair<int64_t, int64_t> kRows[] = {{1, 128}, kWideAndNarrowRows[0], kWideAndNarrowRows[1],
                                                   kWideAndNarrowRows[2]};
  for (const auto& [q_len, heads] : kRows) {
    for (const bool split : {false, true}) {
      SCOPED_TRACE("q_len " + std::to_string(q_len) + " heads " + std::to_string(heads) +
                   (split ? ", split request" : ", whole requests"));
      // Whole requests: as SplitFreeLargeBatch. Split: two long requests on every SM.
      DecodeProblemSpec s = spec_for(dtype(), split ? 2 : 1024, q_len, heads, 64, 1, 256, seed());
      if (split) s.seq_lens = {50000, 60000};
      else s.seq_lens[5] = 200;
      DecodeProblem pb = make_decode_problem(s);
      const int64_t request = split ? 1 : 5, token = split ? 3000 : 0;  // seen by every row of the request
      const int64_t table_cols = pb.block_table.view().shape[1], page_size = pb.kv_cache.shape[1];
      const int64_t page = pb.block_table.data<int32_t>()[request * table_cols + token / page_size];
      const int64_t element = page * pb.kv_cache.strides[0] + (token % page_size) * kCacheRowDim + kLatentDim + 5;
      set(pb.cache_storage, element, std::nan(""));
      ASSERT_TRUE(std::isnan(get(pb.cache_storage, element)));
      check_problem(pb);
    }
  }
}

// An output view walking tokens and heads backwards (negative strides, as a flipped torch view
// has): rows whose offset from out's data pointer is negative must be written too. Short
// requests go out from the main kernel, a long one through the combine.
TEST_P(DecodeGpu, OutputWithNegativeStrides) {
  for (const int32_t len_hi : {300, 40000}) {
    SCOPED_TRACE("longest request " + std::to_string(len_hi));
    DecodeProblemSpec s = spec_for(dtype(), 3, 2, 3, 8, 1, len_hi, seed());
    s.seq_lens.back() = len_hi;
    const DecodeProblem pb = make_decode_problem(s);
    const DecodeResult ref = run_reference(pb);
    DeviceProblem dev(pb);
    dev.out.fill_bytes(0xFF);
    dev.lse.fill_bytes(0xFF);
    const int64_t T = s.q_len, H = s.heads;
    TensorView flipped = dev.out.view();  // [B, T, H, 512]: token t, head h at dense (T-1-t, H-1-h)
    flipped.strides[1] = -H * kLatentDim;
    flipped.strides[2] = -kLatentDim;
    flipped.data = static_cast<uint16_t*>(flipped.data) + ((T - 1) * H + (H - 1)) * kLatentDim;
    mla_decode(dev.q.view(), dev.kv_cache, dev.block_table.view(), dev.seq_lens.view(), flipped, dev.lse.view(),
               dev.workspace.view(), s.softmax_scale, s.output_scale);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const HostTensor dense = dev.out.to_host();
    HostTensor out = dense;
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          std::copy_n(dense.data<uint16_t>() + ((b * T + T - 1 - t) * H + H - 1 - h) * kLatentDim, kLatentDim,
                      out.data<uint16_t>() + ((b * T + t) * H + h) * kLatentDim);
    expect_matches({out, dev.lse.to_host()}, ref, s);
  }
}

// A cache of more than 2^31 elements: the requests' pages sit past the 2^31st element.
TEST_P(DecodeGpu, CacheBeyondTwoGigaElements) {
  // Pages of 64 come through TMA, pages of 1 through the copied-rows producer.
  for (const int64_t page_size : {int64_t{64}, int64_t{1}}) {
    SCOPED_TRACE("page size " + std::to_string(page_size));
    DecodeProblemSpec s = spec_for(dtype(), 2, 2, 16, page_size, 300, 900, seed());
    const DecodeProblem pb = make_decode_problem(s);
    const int64_t esize = static_cast<int64_t>(dtype_size(dtype()));
    const int64_t page_elems = page_size * kCacheRowDim;
    // Every page of the problem lands past element 2^31 (and 64 pages of 64 past it at least).
    const int64_t num_pages = (int64_t{1} << 31) / page_elems + std::max<int64_t>(pb.num_pages, 64 * 64 / page_size) + 1;
    size_t free_bytes = 0, total_bytes = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
    if (free_bytes < static_cast<size_t>(num_pages * page_elems * esize) + (size_t{4} << 30))
      GTEST_SKIP() << "needs " << (num_pages * page_elems * esize >> 20) << " MiB of free device memory";
    const DecodeResult ref = run_reference(pb);
    // Relocate the problem's pages to the top of a huge cache: page p -> num_pages - pb.num_pages + p.
    const int64_t offset_pages = num_pages - pb.num_pages;
    DeviceTensor big(dtype(), {num_pages, page_size, kCacheRowDim});
    ASSERT_EQ(cudaMemset(big.view().data, 0xFF, static_cast<size_t>(num_pages * page_elems * esize)), cudaSuccess);
    const int64_t page_stride = pb.kv_cache.strides[0];
    for (int64_t p = 0; p < pb.num_pages; ++p)
      ASSERT_EQ(cudaMemcpy(static_cast<uint8_t*>(big.view().data) + (offset_pages + p) * page_elems * esize,
                           static_cast<const uint8_t*>(pb.cache_storage.view().data) + p * page_stride * esize,
                           page_elems * esize, cudaMemcpyHostToDevice),
                cudaSuccess);
    HostTensor table = pb.block_table;
    for (int64_t i = 0; i < table.numel(); ++i) table.data<int32_t>()[i] += static_cast<int32_t>(offset_pages);
    DeviceProblem dev(pb);
    dev.block_table.upload(table);
    dev.kv_cache = big.view();
    dev.out.fill_bytes(0xFF);
    dev.lse.fill_bytes(0xFF);
    dev.run(s);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_matches({dev.out.to_host(), dev.lse.to_host()}, ref, s);
  }
}

// Capture once, replay with three different batches (lengths, page tables and queries).
TEST_P(DecodeGpu, CudaGraphReplayWithNewLengthsAndPages) {
  const int64_t B = 8;
  // Every batch shares the shapes (block table width, pool size) so one graph serves all.
  std::vector<DecodeProblem> batches;
  for (int i = 0; i < 3; ++i) {
    DecodeProblemSpec s = spec_for(dtype(), B, 2, 32, 64, 1, 2000, seed() + i);
    s.seq_lens[0] = 2000;  // same table width and pool size across batches
    s.seq_lens[1] = 1;
    int64_t total = 0;
    for (auto l : s.seq_lens) total += (l + 63) / 64;
    s.spare_pages = 400 - total;
    s.table_pad_pages = 2;
    batches.push_back(make_decode_problem(s));
  }
  DeviceProblem dev(batches[0]);
  CapturedGraph graph;
  ASSERT_EQ(graph.capture([&] { dev.run(batches[0].spec, graph.handle()); }), "");
  ASSERT_EQ(graph.ended(), cudaSuccess);
  for (const DecodeProblem& pb : batches) {
    const DecodeResult ref = run_reference(pb);
    ASSERT_EQ(pb.cache_storage.nbytes(), batches[0].cache_storage.nbytes());
    dev.upload(pb);
    dev.out.fill_bytes(0xFF);
    dev.lse.fill_bytes(0xFF);
    ASSERT_EQ(graph.replay(), cudaSuccess);
    expect_matches(dev.download(), ref, pb.spec);
  }
}

INSTANTIATE_TEST_SUITE_P(Types, DecodeGpu, ::testing::Values(DType::kFloat8E4M3, DType::kBFloat16),
                         DtypeParamName());

// The main kernel's shared-memory opt-in is a per-device attribute: every device of the process
// must run decode correctly, not only the first one used (on one GPU this checks the per-device
// path on device 0; a machine with two or more checks the others too).
TEST(DecodeGpuDevices, EveryDeviceSetsItsOwnSharedMemoryOptIn) {
  SPEEDMLA_REQUIRE_GPU();
  int count = 0, previous = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  ASSERT_EQ(cudaGetDevice(&previous), cudaSuccess);
  for (int device = 0; device < count; ++device) {
    int major = 0, minor = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), cudaSuccess);
    ASSERT_EQ(cudaSetDevice(device), cudaSuccess);
    for (DType dtype : {DType::kFloat8E4M3, DType::kBFloat16}) {
      const DecodeProblemSpec s = spec_for(dtype, 3, 2, 16, 64, 1, 700, 11);
      if (major == 9 && minor == 0) {
        check_case(s);
        continue;
      }
      // Any other device is refused by name before anything is launched.
      DeviceProblem dev(make_decode_problem(s));
      try {
        dev.run(s);
        ADD_FAILURE() << "cuda:" << device << " (" << major << "." << minor << ") accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("compute capability"), std::string::npos) << e.what();
      }
    }
  }
  ASSERT_EQ(cudaSetDevice(previous), cudaSuccess);
}

// Refusals that only the GPU path makes.
TEST(DecodeGpuErrors, UnsupportedPageSizeAndSmallWorkspace) {
  SPEEDMLA_REQUIRE_GPU();
  for (int64_t page_size : {24, 256}) {
    DecodeProblemSpec s = spec_for(DType::kBFloat16, 1, 1, 16, page_size, 10, 10, 3);
    const DecodeProblem pb = make_decode_problem(s);
    DeviceProblem dev(pb);
    try {
      dev.run(s);
      FAIL() << "page size " << page_size << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("page_size"), std::string::npos) << e.what();
    }
  }
  DecodeProblemSpec s = spec_for(DType::kBFloat16, 2, 1, 16, 64, 10, 10, 3);
  const DecodeProblem pb = make_decode_problem(s);
  DeviceProblem dev(pb);
  TensorView small = dev.workspace.view();
  small.shape[0] = 16;
  try {
    mla_decode(dev.q.view(), dev.kv_cache, dev.block_table.view(), dev.seq_lens.view(), dev.out.view(),
               dev.lse.view(), small, s.softmax_scale);
    FAIL() << "a 16-byte workspace was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace speedmla::test
