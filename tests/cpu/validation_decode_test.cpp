// mla_decode and mla_decode_workspace_size refuse every bad argument they can check on the host
// with an Error that names the argument; good CPU arguments run the reference. (The checks that
// need a GPU — page sizes the kernels lack, the workspace — are in tests/gpu/decode_test.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string>

#include "api/check.h"
#include "common/op_testing.h"
#include "common/util.h"
#include "speedmla/decode.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr Device kCuda{DeviceKind::kCUDA, 0};
constexpr int64_t kB = 2, kQLen = 2, kH = 3, kPageSize = 4, kNumPages = 5, kMaxPages = 2;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A pointer that must never be dereferenced on the host: the data of a view claiming to be on
// a GPU. Validation has to refuse the call before it reads anything.
void* const kDevicePointer = reinterpret_cast<void*>(uintptr_t{1} << 20);

// The arguments of one mla_decode call.
struct DecodeArgs {
  TensorView q, kv_cache, block_table, seq_lens, out;
  std::optional<TensorView> lse, workspace;
  float softmax_scale = 0.1f, output_scale = 1.0f;
  std::optional<DecodeContextParallel> context_parallel;
  void call() const {
    mla_decode(q, kv_cache, block_table, seq_lens, out, lse, workspace, softmax_scale, output_scale, nullptr,
               context_parallel);
  }
};

// The tensors of a small valid problem: B = 2 requests of q_len = 2 tokens, H = 3 heads, pages of
// 4 rows (any page size is fine on the CPU), request 0 on pages 1, 2 and request 1 on pages 3, 4.
struct DecodeProblem {
  explicit DecodeProblem(DType dtype, int32_t seq_len0 = 7, int32_t seq_len1 = 1)
      : q(dtype, {kB, kQLen, kH, kCacheRowDim}), kv_cache(dtype, {kNumPages, kPageSize, kCacheRowDim}) {
    std::mt19937_64 rng(11);
    fill_uniform(q, rng, -1.0, 1.0);
    fill_uniform(kv_cache, rng, -1.0, 1.0);
    const int32_t pages[kB * kMaxPages] = {1, 2, 3, 4};
    std::copy(std::begin(pages), std::end(pages), block_table.data<int32_t>());
    seq_lens.data<int32_t>()[0] = seq_len0;
    seq_lens.data<int32_t>()[1] = seq_len1;
    fill_bytes(out, 0xFF);  // NaN: every element must be written
    fill_bytes(lse, 0xFF);
  }

  DecodeArgs args() const {
    return {q.view(), kv_cache.view(), block_table.view(), seq_lens.view(), out.view(), lse.view(), std::nullopt};
  }

  HostTensor q, kv_cache, block_table{DType::kInt32, {kB, kMaxPages}}, seq_lens{DType::kInt32, {kB}},
      out{DType::kBFloat16, {kB, kQLen, kH, kLatentDim}}, lse{DType::kFloat32, {kB, kQLen, kH}};
  // Global lengths of a context-parallel call (rank 1 of 2 in the tests below).
  HostTensor causal_seqs{DType::kInt32, {kB}};
};

// Each test breaks one thing of the valid BF16 problem.
class DecodeValidation : public testing::Test {
 protected:
  // Success when mla_decode, called with the valid arguments changed by `breakage`, throws an
  // Error whose message is "mla_decode: <text>...": the argument's name comes first.
  testing::AssertionResult refused(const std::function<void(DecodeArgs&)>& breakage, const std::string& text) {
    DecodeArgs args = problem_.args();
    breakage(args);
    const std::string expected = "mla_decode: " + text;
    return throws_error([&] { args.call(); }, {expected});
  }

  DecodeProblem problem_{DType::kBFloat16};
};

// Success when mla_decode_workspace_size(batch, heads, q_len, sms) throws an Error naming `text`.
testing::AssertionResult workspace_size_refused(int64_t batch, int64_t heads, int64_t q_len, int sms,
                                                const std::string& text) {
  const std::string expected = "mla_decode_workspace_size: " + text;
  return throws_error([&] { (void)mla_decode_workspace_size(batch, heads, q_len, sms); }, {expected});
}

// ---- the positive case ----

// The workspace error of a GPU call names the mla_decode_workspace_size call that sizes it, its
// arguments spelled out only when the check fails (detail::CallArguments).
TEST(DecodeValidationMessages, WorkspaceSizeCallArgumentsAreSpelledOutOnFailure) {
  const speedmla::detail::ArgChecker check("mla_decode");
  EXPECT_NO_THROW(check.require(true, "unused ", speedmla::detail::CallArguments{{1, 16}}));
  try {
    check.require(false, "workspace must hold at least 4096 bytes (mla_decode_workspace_size(",
                  speedmla::detail::CallArguments{{1, 16, 1, 132}}, ")), got 0");
    FAIL() << "require(false, ...) did not throw";
  } catch (const speedmla::Error& e) {
    EXPECT_NE(std::string(e.what()).find("(mla_decode_workspace_size(1, 16, 1, 132)), got 0"), std::string::npos)
        << e.what();
  }
  std::ostringstream empty;
  empty << speedmla::detail::CallArguments{{}};
  EXPECT_EQ(empty.str(), "");
}

TEST_F(DecodeValidation, ValidCpuCallWritesEveryOutputElement) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    SCOPED_TRACE(dtype_name(dtype));
    // Request 1 has seq_len 1 = q_len - 1: its token 0 sees no key (zeros, lse -inf), token 1 one.
    DecodeProblem p(dtype, 7, 1);
    DecodeArgs args = p.args();
    ASSERT_NO_THROW(args.call());
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t t = 0; t < kQLen; ++t)
        for (int64_t h = 0; h < kH; ++h) {
          const int64_t row = (b * kQLen + t) * kH + h;
          const double lse = get(p.lse, row);
          const bool sees_no_key = b == 1 && t == 0;
          if (sees_no_key) {
            EXPECT_TRUE(std::isinf(lse) && lse < 0) << "b " << b << " t " << t << " h " << h << ": " << lse;
          } else {
            EXPECT_TRUE(std::isfinite(lse)) << "b " << b << " t " << t << " h " << h << ": " << lse;
          }
          int64_t bad = 0;
          for (int64_t d = 0; d < kLatentDim; ++d) {
            const double v = get(p.out, row * kLatentDim + d);
            bad += !std::isfinite(v) || (sees_no_key && v != 0.0);
          }
          EXPECT_EQ(bad, 0) << "b " << b << " t " << t << " h " << h;
        }
    // The CPU path is the reference, bit for bit.
    HostTensor expected_out(DType::kBFloat16, {kB, kQLen, kH, kLatentDim}),
        expected_lse(DType::kFloat32, {kB, kQLen, kH});
    reference::mla_decode(args.q, args.kv_cache, args.block_table, args.seq_lens, expected_out.view(),
                          expected_lse.view(), args.softmax_scale, args.output_scale);
    EXPECT_TRUE(bitwise_equal(p.out, expected_out));
    EXPECT_TRUE(bitwise_equal(p.lse, expected_lse));
  }
}

TEST_F(DecodeValidation, EmptyRequestGivesZerosAndMinusInfinityNotNaN) {
  DecodeProblem p(DType::kBFloat16, 5, 0);
  ASSERT_NO_THROW(p.args().call());
  for (int64_t row = kQLen * kH; row < 2 * kQLen * kH; ++row) {  // request 1
    EXPECT_TRUE(std::isinf(get(p.lse, row)) && get(p.lse, row) < 0) << get(p.lse, row);
    for (int64_t d = 0; d < kLatentDim; ++d) ASSERT_EQ(get(p.out, row * kLatentDim + d), 0.0) << row << " " << d;
  }
  for (int64_t row = 0; row < kQLen * kH; ++row) EXPECT_TRUE(std::isfinite(get(p.lse, row)));
}

TEST_F(DecodeValidation, LseAndWorkspaceAreOptionalOnTheCpu) {
  DecodeArgs args = problem_.args();
  args.lse.reset();
  args.workspace.reset();
  EXPECT_NO_THROW(args.call());
}

// ---- q ----

TEST_F(DecodeValidation, QWrongDtype) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.dtype = a.kv_cache.dtype = DType::kFloat32; },
                      "q must be float8_e4m3fn or bfloat16, got float32"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.dtype = a.kv_cache.dtype = DType::kFloat16; }, "q must be"));
}

TEST_F(DecodeValidation, QWrongNumberOfDimensions) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.ndim = 3; }, "q must have 4 dimensions, got 3"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.ndim = 5; a.q.shape[4] = 1; }, "q must have 4 dimensions"));
}

TEST_F(DecodeValidation, QLastDimNot576) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.shape[3] = 512; }, "q.shape[3] must be 576, got 512"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.shape[3] = 577; }, "q.shape[3] must be 576"));
}

TEST_F(DecodeValidation, QLastDimNotContiguous) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.strides[3] = 2; }, "q must be contiguous in its last dimension"));
}

TEST_F(DecodeValidation, QHeadsOutOfRange) {
  for (int64_t heads : {0, 129}) {
    SCOPED_TRACE(heads);
    EXPECT_TRUE(refused([=](DecodeArgs& a) { a.q.shape[2] = a.out.shape[2] = a.lse->shape[2] = heads; },
                        "q.shape[2] (heads) must be in [1, 128], got " + std::to_string(heads)));
  }
}

TEST_F(DecodeValidation, QLenOutOfRange) {
  for (int64_t q_len : {0, 1025}) {
    SCOPED_TRACE(q_len);
    EXPECT_TRUE(refused([=](DecodeArgs& a) { a.q.shape[1] = a.out.shape[1] = a.lse->shape[1] = q_len; },
                        "q.shape[1] (q_len) must be in [1, "));
  }
}

TEST_F(DecodeValidation, QNegativeExtentOrNullData) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.shape[0] = -1; }, "q.shape[0] must be >= 0, got -1"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.data = nullptr; }, "q has a null data pointer"));
}

// ---- kv_cache ----

TEST_F(DecodeValidation, KvCacheDtypeDiffersFromQ) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.kv_cache.dtype = DType::kFloat8E4M3; },
                      "kv_cache must have the dtype of q (bfloat16), got float8_e4m3fn"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.q.dtype = DType::kFloat8E4M3; },
                      "kv_cache must have the dtype of q (float8_e4m3fn), got bfloat16"));
}

TEST_F(DecodeValidation, KvCacheWrongNumberOfDimensions) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.kv_cache.ndim = 2; }, "kv_cache must have 3 dimensions"));
}

TEST_F(DecodeValidation, KvCacheLastDimNot576) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.kv_cache.shape[2] = 512; }, "kv_cache.shape[2] must be 576, got 512"));
}

TEST_F(DecodeValidation, KvCacheNoPages) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.kv_cache.shape[0] = 0; }, "kv_cache.shape[0] (num_pages) must be >= 1"));
}

TEST_F(DecodeValidation, KvCacheEmptyPages) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.kv_cache.shape[1] = 0; }, "kv_cache.shape[1] (page_size) must be >= 1"));
}

TEST_F(DecodeValidation, KvCacheLastDimNotContiguous) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.kv_cache.strides[2] = 2; },
                      "kv_cache must be contiguous in its last dimension"));
}

TEST_F(DecodeValidation, KvCacheRowsNotContiguousInAPage) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.kv_cache.strides[1] = 640; },
                      "kv_cache rows must be contiguous inside a page (stride(1) == 576), got 640"));
}

TEST_F(DecodeValidation, KvCachePageStrideTooSmall) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.kv_cache.strides[0] = 3 * kCacheRowDim; },
                      "kv_cache.stride(0) (the page stride) must be >= page_size * 576 = 2304, got 1728"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.kv_cache.strides[0] = 0; }, "kv_cache.stride(0) (the page stride)"));
}

// ---- block_table ----

TEST_F(DecodeValidation, BlockTableWrongDtype) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.block_table.dtype = DType::kInt64; },
                      "block_table must be int32, got int64"));
}

TEST_F(DecodeValidation, BlockTableWrongNumberOfDimensions) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.block_table.ndim = 1; }, "block_table must have 2 dimensions"));
}

TEST_F(DecodeValidation, BlockTableBatchMismatch) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.block_table.shape[0] = 1; }, "block_table.shape[0] must be 2, got 1"));
}

TEST_F(DecodeValidation, BlockTableLastDimNotContiguous) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.block_table.strides[1] = 2; },
                      "block_table must be contiguous in its last dimension, got stride 2"));
}

// ---- seq_lens ----

TEST_F(DecodeValidation, SeqLensWrongDtype) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.seq_lens.dtype = DType::kInt64; }, "seq_lens must be int32, got int64"));
}

TEST_F(DecodeValidation, SeqLensWrongNumberOfDimensions) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.seq_lens.ndim = 2; a.seq_lens.shape[1] = 1; },
                      "seq_lens must have 1 dimensions"));
}

TEST_F(DecodeValidation, SeqLensBatchMismatch) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.seq_lens.shape[0] = 3; }, "seq_lens.shape[0] must be 2, got 3"));
}

TEST_F(DecodeValidation, SeqLensNotContiguous) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.seq_lens.strides[0] = 2; }, "seq_lens must be contiguous"));
}

// ---- out ----

TEST_F(DecodeValidation, OutWrongDtype) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.dtype = DType::kFloat32; }, "out must be bfloat16, got float32"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.dtype = DType::kFloat8E4M3; }, "out must be bfloat16"));
}

TEST_F(DecodeValidation, OutWrongNumberOfDimensions) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.ndim = 3; }, "out must have 4 dimensions"));
}

TEST_F(DecodeValidation, OutShapeMismatch) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.shape[0] = 1; }, "out.shape[0] must be 2, got 1"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.shape[1] = 1; }, "out.shape[1] must be 2, got 1"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.shape[2] = 2; }, "out.shape[2] must be 3, got 2"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.shape[3] = 576; }, "out.shape[3] must be 512, got 576"));
}

TEST_F(DecodeValidation, OutLastDimNotContiguous) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.strides[3] = 2; }, "out must be contiguous in its last dimension"));
}

// ---- lse ----

TEST_F(DecodeValidation, LseWrongDtype) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.lse->dtype = DType::kBFloat16; }, "lse must be float32, got bfloat16"));
}

TEST_F(DecodeValidation, LseWrongShape) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.lse->ndim = 4; a.lse->shape[3] = 1; }, "lse must have 3 dimensions"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.lse->shape[0] = 3; }, "lse.shape[0] must be 2, got 3"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.lse->shape[1] = 1; }, "lse.shape[1] must be 2, got 1"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.lse->shape[2] = 4; }, "lse.shape[2] must be 3, got 4"));
}

// ---- devices ----

// One argument is a view of (pretend) GPU memory, the others are on the host: the call must be
// refused before anything is read, since the pointer is not host memory.
TEST_F(DecodeValidation, MismatchedDevices) {
  auto on_gpu = [](TensorView& t) {
    t.device = kCuda;
    t.data = kDevicePointer;
  };
  EXPECT_TRUE(refused([&](DecodeArgs& a) { on_gpu(a.kv_cache); }, "kv_cache must be on cpu, got cuda:0"));
  EXPECT_TRUE(refused([&](DecodeArgs& a) { on_gpu(a.block_table); }, "block_table must be on cpu, got cuda:0"));
  EXPECT_TRUE(refused([&](DecodeArgs& a) { on_gpu(a.seq_lens); }, "seq_lens must be on cpu, got cuda:0"));
  EXPECT_TRUE(refused([&](DecodeArgs& a) { on_gpu(a.out); }, "out must be on cpu, got cuda:0"));
  EXPECT_TRUE(refused([&](DecodeArgs& a) { on_gpu(*a.lse); }, "lse must be on cpu, got cuda:0"));
  // q decides the device: a GPU q with host tensors names the first host one.
  EXPECT_TRUE(refused([&](DecodeArgs& a) { on_gpu(a.q); }, "kv_cache must be on cuda:0, got cpu"));
  // Two GPUs: everything on cuda:0 but out on cuda:1 (refused before any CUDA call).
  EXPECT_TRUE(refused(
      [&](DecodeArgs& a) {
        for (TensorView* t : {&a.q, &a.kv_cache, &a.block_table, &a.seq_lens, &a.out, &*a.lse}) on_gpu(*t);
        a.out.device.index = 1;
      },
      "out must be on cuda:0, got cuda:1"));
}

// Every tensor of the call on (pretend) GPU `device`, at distinct addresses 2^36 bytes apart:
// for checks that must refuse the call before any CUDA call or read.
void on_pretend_gpu(DecodeArgs& a, int device) {
  uintptr_t address = 0;
  for (TensorView* t : {&a.q, &a.kv_cache, &a.block_table, &a.seq_lens, &a.out, &*a.lse}) {
    t->device = Device{DeviceKind::kCUDA, device};
    t->data = reinterpret_cast<void*>(address += uintptr_t{1} << 36);
  }
}

// The batch bound of the GPU path (kMaxDecodeBlocks): batch times the 64-token blocks a block
// table row holds stays below 2^30. Pretend tensors of 65536 requests with 2^20-token tables
// are one request too many; 65535 pass that check (and are refused later, for want of a
// workspace or, without a GPU, by the CUDA runtime).
TEST_F(DecodeValidation, BatchTimesTableBlocksBelowTwoToThirty) {
  auto problem = [](int64_t batch) {
    DecodeArgs a{};
    a.q = make_view(nullptr, DType::kBFloat16, {}, {batch, 1, 1, kCacheRowDim});
    a.kv_cache = make_view(nullptr, DType::kBFloat16, {}, {kNumPages, 64, kCacheRowDim});
    a.block_table = make_view(nullptr, DType::kInt32, {}, {batch, int64_t{1} << 14});
    a.seq_lens = make_view(nullptr, DType::kInt32, {}, {batch});
    a.out = make_view(nullptr, DType::kBFloat16, {}, {batch, 1, 1, kLatentDim});
    a.lse = make_view(nullptr, DType::kFloat32, {}, {batch, 1, 1});
    on_pretend_gpu(a, 0);
    return a;
  };
  EXPECT_TRUE(throws_error([&] { problem(65536).call(); },
                           {"mla_decode: q.shape[0] (batch) times the blocks of 64 tokens", "(16384)",
                            "must be < 2^30 on the GPU, got batch 65536"}));
  try {
    problem(65535).call();
    ADD_FAILURE() << "a call without workspace was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("batch"), std::string::npos) << e.what();
  }
}

// A device index past what the capability check caches is refused by name before any CUDA call,
// so this runs the same with or without a GPU.
TEST_F(DecodeValidation, DeviceIndexBeyondTheCapabilityCache) {
  EXPECT_TRUE(refused(
      [&](DecodeArgs& a) {
        on_pretend_gpu(a, 64);
        a.kv_cache = make_view(a.kv_cache.data, DType::kBFloat16, a.kv_cache.device, {kNumPages, 8, kCacheRowDim});
      },
      "CUDA device index must be in [0, 64), got 64"));
}

// ---- overlaps ----

TEST_F(DecodeValidation, OutOverlappingInputs) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.data = a.q.data; }, "out must not overlap q"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.data = static_cast<uint16_t*>(a.q.data) + 100; },
                      "out must not overlap q"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.data = a.kv_cache.data; }, "out must not overlap kv_cache"));
}

TEST_F(DecodeValidation, LseOverlappingOthers) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.lse->data = a.q.data; }, "lse must not overlap q"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.lse->data = a.kv_cache.data; }, "lse must not overlap kv_cache"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.lse->data = a.out.data; }, "lse must not overlap out"));
}

TEST_F(DecodeValidation, WrittenTensorsAddressingAnElementTwice) {
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.out.strides[2] = 0; }, "out is written, so no two of its elements"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.lse->strides[1] = 0; }, "lse is written, so no two of its elements"));
}

TEST_F(DecodeValidation, WrittenTensorsOverlappingTheIndexTensors) {
  // The small index tensor is moved inside the large output, so nothing else overlaps either.
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.seq_lens.data = a.out.data; }, "out must not overlap seq_lens"));
  EXPECT_TRUE(refused([](DecodeArgs& a) { a.block_table.data = a.lse->data; }, "lse must not overlap block_table"));
}

// ---- scales ----

TEST_F(DecodeValidation, SoftmaxScaleNotPositiveOrNotFinite) {
  for (float scale : {0.0f, -0.0f, -0.1f, kNaN, kInf, -kInf}) {
    SCOPED_TRACE(scale);
    EXPECT_TRUE(refused([=](DecodeArgs& a) { a.softmax_scale = scale; }, "softmax_scale must be finite and > 0"));
  }
}

TEST_F(DecodeValidation, OutputScaleNotFinite) {
  for (float scale : {kInf, -kInf, kNaN}) {
    SCOPED_TRACE(scale);
    EXPECT_TRUE(refused([=](DecodeArgs& a) { a.output_scale = scale; }, "output_scale must be finite"));
  }
}

// ---- mla_decode_workspace_size ----

TEST_F(DecodeValidation, WorkspaceSizeOfAValidProblemIsPositive) {
  EXPECT_GT(mla_decode_workspace_size(kB, kH, kQLen, 132), 0u);
  EXPECT_GT(mla_decode_workspace_size(1, 128, 1024, 1), 0u);
}

TEST_F(DecodeValidation, WorkspaceSizeBatchNotPositive) {
  EXPECT_TRUE(workspace_size_refused(0, kH, kQLen, 132, "batch must be >= 1, got 0"));
  EXPECT_TRUE(workspace_size_refused(-1, kH, kQLen, 132, "batch must be >= 1, got -1"));
}

TEST_F(DecodeValidation, WorkspaceSizeHeadsOutOfRange) {
  EXPECT_TRUE(workspace_size_refused(kB, 0, kQLen, 132, "num_heads must be in [1, 128], got 0"));
  EXPECT_TRUE(workspace_size_refused(kB, 129, kQLen, 132, "num_heads must be in [1, 128], got 129"));
}

TEST_F(DecodeValidation, WorkspaceSizeQLenOutOfRange) {
  EXPECT_TRUE(workspace_size_refused(kB, kH, 0, 132, "q_len must be in [1, "));
  EXPECT_TRUE(workspace_size_refused(kB, kH, 1025, 132, "q_len must be in [1, "));
}

TEST_F(DecodeValidation, WorkspaceSizeSmsNotPositive) {
  EXPECT_TRUE(workspace_size_refused(kB, kH, kQLen, 0, "num_sms must be >= 1, got 0"));
  EXPECT_TRUE(workspace_size_refused(kB, kH, kQLen, -4, "num_sms must be >= 1, got -4"));
}

// ---- context_parallel ----

class DecodeContextParallelValidation : public DecodeValidation {
 protected:
  // The valid problem as rank 1 of 2 (7 and 1 local keys: global lengths 14 and 3).
  void make_rank(DecodeArgs& a) {
    problem_.causal_seqs.data<int32_t>()[0] = 14;
    problem_.causal_seqs.data<int32_t>()[1] = 3;
    a.context_parallel = DecodeContextParallel{problem_.causal_seqs.view(), 2, 1};
  }
  testing::AssertionResult cp_refused(const std::function<void(DecodeArgs&)>& breakage, const std::string& text) {
    return refused(
        [&](DecodeArgs& a) {
          make_rank(a);
          breakage(a);
        },
        text);
  }
};

TEST_F(DecodeContextParallelValidation, ValidCallRuns) {
  DecodeArgs args = problem_.args();
  make_rank(args);
  EXPECT_NO_THROW(args.call());
}

TEST_F(DecodeContextParallelValidation, CausalSeqsWrongDtypeShapeOrLayout) {
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->causal_seqs.dtype = DType::kInt64; },
                         "context_parallel.causal_seqs must be int32, got int64"));
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->causal_seqs.shape[0] = 3; },
                         "context_parallel.causal_seqs.shape[0] must be 2, got 3"));
  EXPECT_TRUE(cp_refused(
      [](DecodeArgs& a) {
        a.context_parallel->causal_seqs.ndim = 2;
        a.context_parallel->causal_seqs.shape[1] = 1;
      },
      "context_parallel.causal_seqs must have 1 dimensions"));
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->causal_seqs.strides[0] = 2; },
                         "context_parallel.causal_seqs must be contiguous"));
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->causal_seqs.data = nullptr; },
                         "context_parallel.causal_seqs"));
}

TEST_F(DecodeContextParallelValidation, CausalSeqsOnAnotherDevice) {
  EXPECT_TRUE(cp_refused(
      [](DecodeArgs& a) {
        a.context_parallel->causal_seqs.device = kCuda;
        a.context_parallel->causal_seqs.data = kDevicePointer;
      },
      "context_parallel.causal_seqs must be on cpu, got cuda:0"));
}

TEST_F(DecodeContextParallelValidation, CausalSeqsInsideAWrittenTensor) {
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->causal_seqs.data = a.out.data; },
                         "out must not overlap context_parallel.causal_seqs"));
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->causal_seqs.data = a.lse->data; },
                         "lse must not overlap context_parallel.causal_seqs"));
}

TEST_F(DecodeContextParallelValidation, WorldOutOfRange) {
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->world = 0; },
                         "context_parallel.world must be in [1, 65536], got 0"));
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->world = 65537; },
                         "context_parallel.world must be in [1, 65536], got 65537"));
}

TEST_F(DecodeContextParallelValidation, RankOutOfRange) {
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->rank = -1; },
                         "context_parallel.rank must be in [0, world = 2), got -1"));
  EXPECT_TRUE(cp_refused([](DecodeArgs& a) { a.context_parallel->rank = 2; },
                         "context_parallel.rank must be in [0, world = 2), got 2"));
}

// ---- the 6-argument mla_decode_workspace_size (either split policy) ----

TEST_F(DecodeValidation, WorkspaceSizeOfABalancedPlanIsMlaDecodes) {
  EXPECT_EQ(mla_decode_workspace_size(kB, kH, kQLen, 132, 1 << 20, 0), mla_decode_workspace_size(kB, kH, kQLen, 132));
}

TEST_F(DecodeValidation, WorkspaceSizeOfAnInvariantPlanHoldsEveryPieceOfTheLongestRequests) {
  // 4 SMs, 16 rows: one row tile, 4 parts, 6 slots for the balanced plan.
  const size_t balanced = mla_decode_workspace_size(8, 16, 1, 4);
  // One piece per request: nothing is split, the balanced bound holds.
  EXPECT_EQ(mla_decode_workspace_size(8, 16, 1, 4, 4096, 4096), balanced);
  // Three pieces per request: 8 * 3 = 24 partial results of 16 rows * (512 + 1) FP32 values,
  // 18 more than the balanced plan's (each of the two regions rounded up to 256 bytes).
  const size_t three = mla_decode_workspace_size(8, 16, 1, 4, 3 * 4096, 4096);
  const size_t more = size_t{24 - 6} * 16 * 513 * 4;
  EXPECT_GE(three + 2 * 256, balanced + more);
  EXPECT_LE(three, balanced + more + 2 * 256);
  // A token more than three pieces is a fourth piece; a shorter piece size needs more.
  EXPECT_GT(mla_decode_workspace_size(8, 16, 1, 4, 3 * 4096 + 1, 4096), three);
  EXPECT_GT(mla_decode_workspace_size(8, 16, 1, 4, 3 * 4096, 2048), three);
}

TEST_F(DecodeValidation, WorkspaceSizeRefusesABadSplitOrLength) {
  const std::string split = "mla_decode_workspace_size: invariant_split_tokens must be 0 (the balanced plan) or a "
                            "positive multiple of 64";
  for (int64_t tokens : {int64_t{-64}, int64_t{100}, int64_t{1} << 31}) {
    SCOPED_TRACE(tokens);
    EXPECT_TRUE(throws_error([&] { (void)mla_decode_workspace_size(kB, kH, kQLen, 132, 4096, tokens); }, {split}));
  }
  EXPECT_TRUE(throws_error([&] { (void)mla_decode_workspace_size(kB, kH, kQLen, 132, 0, 4096); },
                           {"mla_decode_workspace_size: max_kv_tokens must be in [1, 2^31), got 0"}));
  // 2^24 requests of 128 blocks are 2^31 blocks: past the planner's 2^30.
  EXPECT_TRUE(throws_error([&] { (void)mla_decode_workspace_size(int64_t{1} << 24, kH, kQLen, 132, 8192, 4096); },
                           {"mla_decode_workspace_size: batch times the 64-token blocks of max_kv_tokens (128"}));
}

// ---- mla_decode_plan and mla_decode_with_plan ----

DecodePlan plan_for(const DecodeArgs& args, int64_t split_tokens = 0) {
  return mla_decode_plan(args.seq_lens, args.block_table, args.q.shape[2], args.q.shape[1], args.q.dtype,
                         args.kv_cache.shape[1], args.workspace, split_tokens);
}

void call_with_plan(const DecodePlan& plan, const DecodeArgs& args) {
  mla_decode_with_plan(plan, args.q, args.kv_cache, args.block_table, args.seq_lens, args.out, args.lse,
                       args.softmax_scale, args.output_scale);
}

TEST_F(DecodeValidation, WithPlanOnTheCpuGivesMlaDecodesBits) {
  for (int64_t split : {int64_t{0}, int64_t{64}}) {
    SCOPED_TRACE(split);
    DecodeProblem planned(DType::kBFloat16), direct(DType::kBFloat16);
    const DecodeArgs args = planned.args();
    const DecodePlan plan = plan_for(args, split);
    EXPECT_TRUE(plan.made);
    EXPECT_EQ(plan.batch, kB);
    EXPECT_EQ(plan.invariant_split_tokens, split);
    // Reused: two "layers" on one plan.
    for (int layer = 0; layer < 2; ++layer) ASSERT_NO_THROW(call_with_plan(plan, args));
    direct.args().call();
    EXPECT_TRUE(bitwise_equal(planned.out, direct.out));
    EXPECT_TRUE(bitwise_equal(planned.lse, direct.lse));
  }
}

// Success when mla_decode_with_plan(plan, args) throws an Error "mla_decode_with_plan: <text>".
testing::AssertionResult plan_refused(const DecodePlan& plan, const DecodeArgs& args, const std::string& text) {
  return throws_error([&] { call_with_plan(plan, args); }, {"mla_decode_with_plan: " + text});
}

TEST_F(DecodeValidation, WithPlanRefusesAPlanMadeForOtherShapes) {
  const DecodeArgs args = problem_.args();
  const TensorView& sl = args.seq_lens;
  const TensorView& bt = args.block_table;
  auto plan = [&](const TensorView& seq_lens, const TensorView& table, int64_t heads, int64_t q_len, DType dtype,
                  int64_t page_size) {
    return mla_decode_plan(seq_lens, table, heads, q_len, dtype, page_size, std::nullopt);
  };
  const std::string remake = " (make a plan for this call with mla_decode_plan)";
  EXPECT_TRUE(plan_refused(DecodePlan{}, args, "plan must come from mla_decode_plan, got a default-constructed"));
  TensorView one_seq = sl, one_row = bt;
  one_seq.shape[0] = one_row.shape[0] = 1;
  EXPECT_TRUE(plan_refused(plan(one_seq, one_row, kH, kQLen, DType::kBFloat16, kPageSize), args,
                           "plan was made for a batch of 1 requests, got q.shape[0] = 2" + remake));
  EXPECT_TRUE(plan_refused(plan(sl, bt, kH + 1, kQLen, DType::kBFloat16, kPageSize), args,
                           "plan was made for 4 heads, got q.shape[2] = 3" + remake));
  EXPECT_TRUE(plan_refused(plan(sl, bt, kH, 1, DType::kBFloat16, kPageSize), args,
                           "plan was made for q_len 1, got q.shape[1] = 2" + remake));
  EXPECT_TRUE(plan_refused(plan(sl, bt, kH, kQLen, DType::kFloat8E4M3, kPageSize), args,
                           "plan was made for float8_e4m3fn q and kv_cache, got bfloat16" + remake));
  TensorView narrow = bt;
  narrow.shape[1] = 1;
  EXPECT_TRUE(plan_refused(plan(sl, narrow, kH, kQLen, DType::kBFloat16, kPageSize), args,
                           "plan was made for a block table of 1 pages per request, got block_table.shape[1] = 2" +
                               remake));
  EXPECT_TRUE(plan_refused(plan(sl, bt, kH, kQLen, DType::kBFloat16, 2 * kPageSize), args,
                           "plan was made for page_size 8, got kv_cache.shape[1] = 4" + remake));
  const HostTensor copy = problem_.seq_lens;  // the same values elsewhere: the plan cannot know them
  EXPECT_TRUE(plan_refused(plan(copy.view(), bt, kH, kQLen, DType::kBFloat16, kPageSize), args,
                           "seq_lens must be the tensor the plan was made from"));
  DecodePlan elsewhere = plan(sl, bt, kH, kQLen, DType::kBFloat16, kPageSize);
  elsewhere.device = kCuda;
  EXPECT_TRUE(plan_refused(elsewhere, args, "plan was made on cuda:0, got tensors on cpu" + remake));
  // The call's own arguments are checked first, as by mla_decode.
  DecodeArgs broken = args;
  broken.softmax_scale = kNaN;
  EXPECT_TRUE(plan_refused(plan(sl, bt, kH, kQLen, DType::kBFloat16, kPageSize), broken,
                           "softmax_scale must be finite and > 0"));
}

TEST_F(DecodeValidation, PlanRefusesBadArguments) {
  const DecodeArgs args = problem_.args();
  auto refused_plan = [&](const std::function<DecodePlan()>& make, const std::string& text) {
    return throws_error([&] { (void)make(); }, {"mla_decode_plan: " + text});
  };
  const TensorView& sl = args.seq_lens;
  const TensorView& bt = args.block_table;
  constexpr DType kBf16 = DType::kBFloat16;
  EXPECT_TRUE(refused_plan([&] { return mla_decode_plan(sl, bt, 0, kQLen, kBf16, kPageSize, std::nullopt); },
                           "num_heads must be in [1, 128], got 0"));
  EXPECT_TRUE(refused_plan([&] { return mla_decode_plan(sl, bt, kH, 1025, kBf16, kPageSize, std::nullopt); },
                           "q_len must be in [1, 1024], got 1025"));
  EXPECT_TRUE(refused_plan([&] { return mla_decode_plan(sl, bt, kH, kQLen, DType::kFloat32, kPageSize, std::nullopt); },
                           "dtype must be float8_e4m3fn or bfloat16"));
  EXPECT_TRUE(refused_plan([&] { return mla_decode_plan(sl, bt, kH, kQLen, kBf16, 0, std::nullopt); },
                           "page_size must be >= 1, got 0"));
  EXPECT_TRUE(refused_plan([&] { return mla_decode_plan(sl, bt, kH, kQLen, kBf16, kPageSize, std::nullopt, 100); },
                           "invariant_split_tokens must be 0 (the balanced plan) or a positive multiple of 64"));
  EXPECT_TRUE(refused_plan([&] { return mla_decode_plan(bt, bt, kH, kQLen, kBf16, kPageSize, std::nullopt); },
                           "seq_lens must have 1 dimension"));
  TensorView one_row = bt;
  one_row.shape[0] = 1;
  EXPECT_TRUE(refused_plan([&] { return mla_decode_plan(sl, one_row, kH, kQLen, kBf16, kPageSize, std::nullopt); },
                           "block_table.shape[0] must be 2"));
  // Tensors on a GPU with a CPU workspace: refused before anything is read or launched.
  TensorView gpu_seq = sl, gpu_table = bt;
  gpu_seq.data = gpu_table.data = kDevicePointer;
  gpu_seq.device = gpu_table.device = kCuda;
  const HostTensor cpu_workspace(DType::kUInt8, {256});
  EXPECT_TRUE(refused_plan(
      [&] { return mla_decode_plan(gpu_seq, gpu_table, kH, kQLen, kBf16, 64, cpu_workspace.view()); },
      "workspace must be on cuda:0"));
}

}  // namespace
}  // namespace speedmla::test
