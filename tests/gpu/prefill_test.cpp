// mla_prefill on the GPU against the CPU reference: fresh normal data (the seed is printed;
// SPEEDMLA_TEST_SEED replays it), poisoned outputs, every element of every request checked,
// bounds asserted request by request.
//
// The reference runs on the CPU (FP64, (row, head) pairs spread over the cores): the batches are
// sized so that the whole file takes well under a minute on the GPU machine's 16 cores, which
// keeps the longest requests (383 and 1000 rows) to the cells with fewer heads; every cell still
// crosses the tile sizes 64 and 128 (63/64/65, 127/128/129, 200 rows).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/views.h"
#include "common/captured_graph.h"
#include "common/dtype_gpu_test.h"
#include "common/error_budget.h"
#include "common/prefill_problem.h"
#include "common/util.h"

namespace speedmla::test {
namespace {

// Bounds per request: tests/common/error_budget.h (prefill_bounds).
PrefillBounds bounds(DType dtype) {
  const ErrorBounds b = prefill_bounds(dtype);
  return {b.out_rel_l2, b.lse_max_abs};
}

// Runs one problem on the GPU, compares every request with the reference, reports and asserts.
void check_case(const PrefillProblemSpec& spec) {
  const PrefillProblem pb = make_prefill_problem(spec);
  const PrefillResult ref = prefill_reference(pb);
  DevicePrefill dev(pb);
  dev.run(spec);
  const PrefillErrors errors = compare_prefill(pb, dev.download(), ref);
  report(pb, errors.worst_out, errors.worst_lse);
  expect_within(pb, errors, bounds(spec.dtype));
}

PrefillProblemSpec make_spec(const std::string& name, DType dtype, int64_t heads, int64_t kv_heads, bool causal,
                             std::vector<PrefillLengths> requests) {
  return {.name = name, .dtype = dtype, .heads = heads, .kv_heads = kv_heads, .causal = causal,
          .requests = std::move(requests)};
}

// The ragged batch of edge cases; the longest requests only where the reference can afford them.
std::vector<PrefillLengths> edge_requests(int64_t heads) {
  std::vector<PrefillLengths> r = {
      {0, 0}, {0, 17},                // no query, with and without keys
      {5, 0},                         // no key: out 0, lse -inf
      {1, 1}, {1, 300},               // one query
      {200, 1}, {150, 70},            // len_q > len_k: causal rows [0, len_q - len_k) see no key
      {70, 150},                      // len_q < len_k
      {63, 63}, {64, 64}, {65, 65},   // around the tile sizes
      {127, 127}, {128, 128}, {129, 129}, {200, 200},
  };
  if (heads <= 32) r.insert(r.end(), {{383, 129}, {65, 383}, {383, 383}});
  if (heads <= 16) r.push_back({1000, 1000});
  r.push_back({0, 9});  // an empty request last
  return r;
}

// 320 requests of 0 to 32 queries and keys (a few with none of either).
std::vector<PrefillLengths> many_small_requests(std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> len(0, 32);
  std::vector<PrefillLengths> r(320);
  for (size_t i = 0; i < r.size(); ++i) {
    r[i].k = len(rng);
    r[i].q = i % 4 == 0 ? r[i].k : len(rng);  // every fourth a plain self-attention request
  }
  return r;
}

class PrefillGpu : public DtypeGpuTest {};

TEST_P(PrefillGpu, RaggedEdgeCases) {
  for (bool causal : {true, false})
    for (int64_t heads : {16, 32, 64, 128})
      for (int64_t kv_heads : {heads, int64_t{1}})
        check_case(make_spec("edges", dtype(), heads, kv_heads, causal, edge_requests(heads)));
}

TEST_P(PrefillGpu, ManySmallRequests) {
  for (bool causal : {true, false})
    for (int64_t heads : {16, 128})
      for (int64_t kv_heads : {heads, int64_t{1}}) {
        std::mt19937_64 rng = case_rng("many-small lengths");
        check_case(make_spec("many-small", dtype(), heads, kv_heads, causal, many_small_requests(rng)));
      }
}

// A huge output_scale over the ragged edge cases, which hold rows that see no key (causal, len_q
// > len_k): those rows must stay exactly 0, not 0 * output_scale / (a sum the FP8 softmax's
// FMA-pipe exponentials once made 2^-125 times the keys, not 0) = NaN. The GPU fuzz found it.
TEST_P(PrefillGpu, RowsThatSeeNoKeyStayZeroUnderAHugeOutputScale) {
  PrefillProblemSpec s = make_spec("no-key-rows", dtype(), 16, 1, true, edge_requests(16));
  s.output_scale = 1e30f;
  check_case(s);
}

// Head counts off the powers of two (H from 1 up, any multiple of H_kv).
TEST_P(PrefillGpu, OddHeadCounts) {
  for (auto [heads, kv_heads] : {std::pair<int64_t, int64_t>{1, 1}, {3, 1}, {3, 3}, {20, 5}, {20, 20}})
    check_case(make_spec("odd-heads", dtype(), heads, kv_heads, true, edge_requests(64)));
}

// Scores of tens (softmax_scale 0.5): a few keys dominate each row and its running maximum moves
// from tile to tile, which exercises the online softmax's rescaling.
TEST_P(PrefillGpu, SharpSoftmax) {
  for (bool causal : {true, false}) {
    PrefillProblemSpec spec = make_spec("sharp", dtype(), 16, 16, causal, edge_requests(32));
    spec.softmax_scale = 0.5f;
    check_case(spec);
  }
}

// A NaN in one query row (one element of one head of one token) makes that row's out and LSE NaN
// when the row sees keys, as the reference's softmax does, and leaves it 0 and -inf when it sees
// none; every other row comes out as without the NaN. (fmaxf drops NaN, so the running max of an
// all-NaN score row stays -inf: such a row must not pass for one that saw no key, whose out 0 and
// LSE -inf a chunked merge would silently drop.)
TEST_P(PrefillGpu, NaNQueryPoisonsItsRowOnly) {
  struct NanRow {
    int64_t request, row, head;
  };
  for (bool causal : {true, false})
    for (int64_t heads : {16, 128}) {
      SCOPED_TRACE(std::string(causal ? "causal" : "non-causal") + " heads " + std::to_string(heads));
      const PrefillProblemSpec spec = make_spec("nan-query", dtype(), heads, 1, causal, edge_requests(heads));
      PrefillProblem pb = make_prefill_problem(spec);
      const PrefillResult ref = prefill_reference(pb);  // of the data without the NaNs
      // Request 6 is {150, 70}: causal, its rows below 80 see no key. Request 13 is {129, 129}:
      // its last row starts a tile of its own; request 3 is {1, 1}.
      const NanRow nan_rows[] = {{6, 10, 0}, {6, 149, heads - 1}, {13, 128, heads / 2}, {3, 0, 1}, {8, 62, 0}};
      const int64_t q_offset =
          (static_cast<const uint8_t*>(pb.q.data) - pb.q_storage.data<uint8_t>()) / static_cast<int64_t>(dtype_size(dtype()));
      for (const NanRow& n : nan_rows) {
        const int64_t element = q_offset + (pb.q_begin[n.request] + n.row) * pb.q.strides[0] + n.head * pb.q.strides[1] + 7;
        set(pb.q_storage, element, std::nan(""));
        ASSERT_TRUE(std::isnan(get(pb.q_storage, element)));
      }
      DevicePrefill dev(pb);
      dev.run(spec);
      PrefillResult gpu = dev.download();
      for (const NanRow& n : nan_rows) {
        const int64_t r = (pb.q_begin[n.request] + n.row) * heads + n.head;  // (token, head) row of out and lse
        const bool sees_keys = get(ref.lse, r) != -INFINITY;
        SCOPED_TRACE("request " + std::to_string(n.request) + " row " + std::to_string(n.row) + " head " +
                     std::to_string(n.head) + (sees_keys ? " (sees keys)" : " (sees no key)"));
        if (sees_keys) {
          EXPECT_TRUE(std::isnan(get(gpu.lse, r))) << get(gpu.lse, r);
          for (int64_t d = 0; d < kPrefillVDim; ++d)
            EXPECT_TRUE(std::isnan(get(gpu.out, r * kPrefillVDim + d))) << "dim " << d << ": " << get(gpu.out, r * kPrefillVDim + d);
        } else {
          EXPECT_EQ(get(gpu.lse, r), -INFINITY);
          for (int64_t d = 0; d < kPrefillVDim; ++d) EXPECT_EQ(get(gpu.out, r * kPrefillVDim + d), 0.0) << "dim " << d;
        }
        // The rest of the problem is checked against the reference with this row taken from it.
        set(gpu.lse, r, get(ref.lse, r));
        for (int64_t d = 0; d < kPrefillVDim; ++d) set(gpu.out, r * kPrefillVDim + d, get(ref.out, r * kPrefillVDim + d));
      }
      const PrefillErrors errors = compare_prefill(pb, gpu, ref);
      report(pb, errors.worst_out, errors.worst_lse);
      expect_within(pb, errors, bounds(spec.dtype));
    }
}

// One request of more than 32K tokens, and a short one before it. The reference checks a sample
// of its rows (first and last, tile boundaries ±1, random ones), each as a one-row request over
// the keys it sees; every other element must be finite (written, and no NaN from the poison).
TEST_P(PrefillGpu, LongRequestSampledRows) {
  const PrefillProblemSpec spec = make_spec("long", dtype(), 16, 16, true, {{3, 40}, {32805, 32805}});
  const PrefillProblem pb = make_prefill_problem(spec);
  DevicePrefill dev(pb);
  dev.run(spec);
  const PrefillResult gpu = dev.download();

  const PrefillResult ref_short = prefill_reference_rows(pb, 0, {0, 1, 2});
  const RequestErrors short_errors = compare_rows(pb, 0, select_rows(gpu, pb.q_begin[0], {0, 1, 2}), ref_short);
  std::mt19937_64 rng = case_rng(spec.label() + " rows");
  const std::vector<int64_t> rows = sample_rows(spec.requests[1].q, 8, rng);
  const RequestErrors long_errors =
      compare_rows(pb, 1, select_rows(gpu, pb.q_begin[1], rows), prefill_reference_rows(pb, 1, rows));
  int64_t nonfinite = 0;
  for (int64_t i = 0; i < pb.q_begin.back() * spec.heads * kPrefillVDim; ++i) nonfinite += !std::isfinite(get(gpu.out, i));
  for (int64_t i = 0; i < pb.q_begin.back() * spec.heads; ++i) nonfinite += !std::isfinite(get(gpu.lse, i));

  report(pb, std::max(short_errors.out.rel_l2, long_errors.out.rel_l2),
         std::max(short_errors.lse.max_abs, long_errors.lse.max_abs), "(" + std::to_string(rows.size()) + " rows sampled)");
  expect_within(pb, short_errors, bounds(dtype()));
  expect_within(pb, long_errors, bounds(dtype()));
  EXPECT_EQ(nonfinite, 0) << spec.label() << ": every row sees a key, so every element must be finite";
}

// q, k and v as views of wider buffers: heads padded (head stride D + 16 bytes), or tokens
// padded (token stride H·D + 16 bytes); the gaps hold NaN.
TEST_P(PrefillGpu, StridedViews) {
  const int64_t pad = 16 / static_cast<int64_t>(dtype_size(dtype()));
  PrefillProblemSpec heads_padded = make_spec("head-padded", dtype(), 32, 32, true, edge_requests(64));
  heads_padded.head_pad = pad;
  check_case(heads_padded);
  PrefillProblemSpec tokens_padded = make_spec("token-padded", dtype(), 16, 1, false, edge_requests(64));
  tokens_padded.token_pad = 3 * pad;
  check_case(tokens_padded);
  PrefillProblemSpec both = make_spec("both-padded", dtype(), 16, 4, true, edge_requests(64));
  both.head_pad = 2 * pad;
  both.token_pad = pad;
  both.output_scale = 0.5f;
  check_case(both);
}

// mla_prefill reads the lengths on the device and neither synchronises nor allocates: captured
// once in a CUDA graph, it replays batches of other lengths (same buffers, same B) correctly.
// FP8 also with values in the kFp8Transposed layout (whose kernel shifts blocks by each
// request's first key: read on the device too).
void check_graph_replay(DType dtype, PrefillValueLayout v_layout) {
  // Each batch has as many query rows as key rows, so that one set of buffers (600 rows, the rest
  // spare) serves all three.
  const std::vector<std::vector<PrefillLengths>> batches = {
      {{100, 100}, {0, 5}, {300, 295}, {1, 1}},
      {{1, 1}, {64, 64}, {129, 200}, {200, 129}},
      {{400, 440}, {3, 2}, {0, 0}, {65, 26}},
  };
  const int64_t rows = 600;
  std::vector<PrefillProblem> problems;
  for (size_t i = 0; i < batches.size(); ++i) {
    PrefillProblemSpec spec = make_spec("graph-" + std::to_string(i), dtype, 16, 16, true, batches[i]);
    spec.v_layout = v_layout;
    int64_t used = 0;
    for (const PrefillLengths& r : batches[i]) used += r.q;
    spec.spare_rows = rows - used;
    problems.push_back(make_prefill_problem(spec));
  }
  DevicePrefill dev(problems[0]);
  const PrefillProblemSpec& s = problems[0].spec;
  CapturedGraph graph;
  const std::string refused = graph.capture([&] {
    mla_prefill(dev.q, dev.k, dev.v, s.v_layout, dev.cu_q.view(), dev.cu_k.view(), dev.out.view(), dev.lse.view(),
                s.causal, s.softmax_scale, s.output_scale, graph.handle());
  });
  ASSERT_TRUE(refused.empty()) << refused;
  ASSERT_EQ(graph.ended(), cudaSuccess) << "mla_prefill must be capturable (no host sync, no allocation)";
  for (const PrefillProblem& pb : problems) {
    dev.q_storage.upload(pb.q_storage);
    dev.k_storage.upload(pb.k_storage);
    dev.v_storage.upload(pb.v_storage);
    if (v_layout == PrefillValueLayout::kFp8Transposed) dev.v_transposed.upload(pb.v_transposed);
    dev.cu_q.upload(pb.cu_q);
    dev.cu_k.upload(pb.cu_k);
    dev.out.fill_bytes(0xFF);
    dev.lse.fill_bytes(0xFF);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the graph's stream does not wait for the default one
    ASSERT_EQ(graph.replay(), cudaSuccess);
    const PrefillErrors errors = compare_prefill(pb, dev.download(), prefill_reference(pb));
    report(pb, errors.worst_out, errors.worst_lse, "(graph replay)");
    expect_within(pb, errors, bounds(dtype));
  }
}

TEST_P(PrefillGpu, CudaGraphReplayWithNewLengths) {
  check_graph_replay(dtype(), PrefillValueLayout::kTokenMajor);
  if (dtype() == DType::kFloat8E4M3) check_graph_replay(dtype(), PrefillValueLayout::kFp8Transposed);
}

// FP8 values already transposed (PrefillValueLayout::kFp8Transposed), the kernel that reads them
// as they arrive: the ragged edge cases (requests starting off the layout's 16-token groups, so
// first blocks hold other requests' tokens; NaN in the spare rows and in positions no token
// owns, which must not reach any output), and many small requests, against the same reference.
TEST(PrefillGpuTransposedValues, RaggedEdgeCasesAndManySmallRequests) {
  SPEEDMLA_REQUIRE_GPU();
  for (bool causal : {true, false})
    for (int64_t heads : {16, 128})
      for (int64_t kv_heads : {heads, int64_t{1}}) {
        PrefillProblemSpec spec = make_spec("edges", DType::kFloat8E4M3, heads, kv_heads, causal, edge_requests(heads));
        spec.v_layout = PrefillValueLayout::kFp8Transposed;
        check_case(spec);
        std::mt19937_64 rng = case_rng("many-small lengths");
        spec = make_spec("many-small", DType::kFloat8E4M3, heads, kv_heads, causal, many_small_requests(rng));
        spec.v_layout = PrefillValueLayout::kFp8Transposed;
        check_case(spec);
      }
}

// A small batch of the same kind, quick enough for compute-sanitizer (gpu-check.sh --sanitize):
// requests starting off the layout's groups, tails past them, empty ones.
TEST(PrefillGpuTransposedValues, SmallRaggedBatch) {
  SPEEDMLA_REQUIRE_GPU();
  const std::vector<PrefillLengths> requests = {{0, 17}, {5, 0}, {1, 300}, {150, 70}, {70, 150}, {65, 65}, {0, 9}};
  for (bool causal : {true, false}) {
    PrefillProblemSpec spec = make_spec("small", DType::kFloat8E4M3, 16, causal ? 16 : 1, causal, requests);
    spec.v_layout = PrefillValueLayout::kFp8Transposed;
    check_case(spec);
  }
}

INSTANTIATE_TEST_SUITE_P(Types, PrefillGpu, ::testing::Values(DType::kFloat8E4M3, DType::kBFloat16),
                         DtypeParamName());

// What the GPU path refuses (the CPU reference takes any strides): data pointers not 16-byte
// aligned and strides other than the last that are not multiples of 16 bytes.
TEST(PrefillGpuErrors, MisalignedStridesAndPointers) {
  SPEEDMLA_REQUIRE_GPU();
  for (DType dtype : {DType::kFloat8E4M3, DType::kBFloat16}) {
    const int64_t e = static_cast<int64_t>(dtype_size(dtype)), eight_bytes = 8 / e;
    PrefillProblemSpec spec = make_spec("refused", dtype, 4, 2, true, {{7, 9}});
    spec.head_pad = eight_bytes;  // room for head strides 8 bytes past the head dim
    spec.token_pad = 16 / e;
    const PrefillProblem pb = make_prefill_problem(spec);
    DevicePrefill dev(pb);
    // The aligned views, packed: head stride D, token stride H·D (+ 16 bytes).
    auto packed = [&](TensorView v) {
      v.strides[1] = v.shape[2];
      v.strides[0] = v.shape[1] * v.shape[2] + 16 / e;
      return v;
    };
    const TensorView q = packed(dev.q), k = packed(dev.k), v = packed(dev.v);
    struct Bad {
      const char* name;
      TensorView q, k, v;
    };
    std::vector<Bad> cases;
    for (const char* name : {"q", "k", "v"}) {
      auto with = [&](const std::function<void(TensorView&)>& change) {
        Bad bad{name, q, k, v};
        TensorView& t = name[0] == 'q' ? bad.q : name[0] == 'k' ? bad.k : bad.v;
        change(t);
        cases.push_back(bad);
      };
      with([&](TensorView& t) { t.strides[0] += eight_bytes; });  // token stride 8 bytes off
      with([&](TensorView& t) { t.strides[1] += eight_bytes; });  // head stride 8 bytes off
      with([&](TensorView& t) {                                   // data 8 bytes past the alignment
        t = detail::slice_last(t, eight_bytes, t.shape[2]);
      });
    }
    for (const Bad& bad : cases) {
      try {
        mla_prefill(bad.q, bad.k, bad.v, dev.cu_q.view(), dev.cu_k.view(), dev.out.view(), dev.lse.view(), true,
                    spec.softmax_scale);
        ADD_FAILURE() << dtype_name(dtype) << ": a misaligned " << bad.name << " was accepted";
      } catch (const Error& error) {
        const std::string message = error.what();
        EXPECT_EQ(message.find("not available"), std::string::npos) << message;
        // The message names the argument: "... q.stride(0) ..." or "... q data ...".
        const std::string name = std::string(" ") + bad.name;
        EXPECT_TRUE(message.find(name + ".") != std::string::npos || message.find(name + " ") != std::string::npos)
            << message;
        EXPECT_NE(message.find("16"), std::string::npos) << message;
      }
    }
    // The same views with the alignment restored run.
    EXPECT_NO_THROW(mla_prefill(q, k, v, dev.cu_q.view(), dev.cu_k.view(), dev.out.view(), dev.lse.view(), true,
                                spec.softmax_scale));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
}

}  // namespace
}  // namespace speedmla::test
