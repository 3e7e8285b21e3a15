// mla_decode_plan / mla_decode_with_plan on the GPU: a plan made once and reused by several
// layers gives the reference's results (and, for the balanced policy, mla_decode's bits), also
// inside a CUDA graph; and the batch-invariant policy gives a request the same bits whatever
// else is in its batch.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/captured_graph.h"
#include "common/decode_problem.h"
#include "common/dtype_gpu_test.h"
#include "common/op_testing.h"
#include "common/util.h"
#include "kernels/decode/sm90/workspace.h"

namespace speedmla::test {
namespace {

// Rows [first, first + count) of dimension 0 of a view.
TensorView rows_of(TensorView t, int64_t first, int64_t count) {
  t.data = static_cast<char*>(t.data) + first * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  t.shape[0] = count;
  return t;
}

DecodeProblemSpec spec_with(DType dtype, int64_t batch, int64_t heads, int64_t q_len, std::vector<int32_t> lens,
                            uint64_t seed) {
  DecodeProblemSpec s;
  s.dtype = dtype;
  s.batch = batch;
  s.heads = heads;
  s.q_len = q_len;
  s.seq_lens = std::move(lens);
  s.seed = seed;
  return s;
}

DecodePlan plan_on(const DeviceProblem& dev, const DecodeProblemSpec& s, const TensorView& workspace,
                   int64_t split_tokens, Stream stream = nullptr) {
  return mla_decode_plan(dev.seq_lens.view(), dev.block_table.view(), s.heads, s.q_len, s.dtype, s.page_size,
                         workspace, split_tokens, stream);
}

void run_on_plan(const DecodePlan& plan, const DeviceProblem& dev, const DecodeProblemSpec& s, Stream stream = nullptr) {
  mla_decode_with_plan(plan, dev.q.view(), dev.kv_cache, dev.block_table.view(), dev.seq_lens.view(), dev.out.view(),
                       dev.lse.view(), s.softmax_scale, s.output_scale, stream);
}

class DecodePlanGpu : public DtypeGpuTest {};

// The split requests' completion counters (kernels/decode/sm90/slot_handover.cuh) are zero after
// every operation, run directly or on a reused plan, whatever the workspace held before: the
// next layer on the plan starts from them, and a counter left complete would let its combine
// read partial results before the main kernel rewrites them.
TEST_P(DecodePlanGpu, SplitCountersAreZeroAfterEachOperation) {
  const DecodeProblemSpec s = spec_with(dtype(), 4, 16, 4, {50000, 60000, 70000, 80000}, seed());
  const DecodeProblem pb = make_decode_problem(s);
  const DecodeResult ref = run_reference(pb);
  DeviceProblem dev(pb);
  const kernels::decode_sm90::WorkspaceLayout layout =
      kernels::decode_sm90::workspace_layout(s.batch, s.heads, s.q_len, device_sm_count(0));
  ASSERT_GT(layout.num_slots, 0);
  auto expect_counters_zero = [&](const std::string& after) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const HostTensor bytes = dev.workspace.to_host();
    int32_t value = 0;
    for (int i = 0; i < layout.num_slots; ++i) {
      std::memcpy(&value, bytes.data<uint8_t>() + layout.slot_writers_offset + 4 * i, 4);
      EXPECT_EQ(value, 0) << "after " << after << ": writers of slot " << i;
    }
    for (int i = 0; i < layout.max_split_requests; ++i) {
      std::memcpy(&value, bytes.data<uint8_t>() + layout.combine_finished_offset + 4 * i, 4);
      EXPECT_EQ(value, 0) << "after " << after << ": CTAs finished with split request " << i;
    }
  };
  dev.workspace.fill_bytes(0x01);  // every counter far past complete
  dev.run(s);
  expect_matches(dev.download(), ref, s);
  expect_counters_zero("mla_decode");
  const DecodePlan plan = plan_on(dev, s, dev.workspace.view(), 0);
  for (int layer = 0; layer < 3; ++layer) {
    dev.out.fill_bytes(0xFF);
    dev.lse.fill_bytes(0xFF);
    run_on_plan(plan, dev, s);
    expect_counters_zero("layer " + std::to_string(layer) + " on a reused plan");
    expect_matches(dev.download(), ref, s);
  }
}

// Layers of one step: the same seq_lens (one device tensor), each layer its own query, cache
// and page table of the same shapes. One plan, then every layer on it.
TEST_P(DecodePlanGpu, OnePlanServesEveryLayerOfAStep) {
  for (int64_t split : {int64_t{0}, int64_t{1024}}) {
    std::mt19937_64 rng(seed() + split);
    const std::vector<int32_t> lens = random_lengths(rng, 6, 1, 9000);
    std::vector<DecodeProblem> layers;
    for (int layer = 0; layer < 3; ++layer)
      layers.push_back(make_decode_problem(spec_with(dtype(), 6, 32, 2, lens, seed() + 100 * layer + split)));
    const DecodeProblemSpec& s = layers[0].spec;
    DeviceProblem dev(layers[0]);
    const int64_t max_tokens = dev.block_table.view().shape[1] * s.page_size;
    DeviceTensor workspace(DType::kUInt8, {static_cast<int64_t>(mla_decode_workspace_size(
                                              s.batch, s.heads, s.q_len, device_sm_count(0), max_tokens, split))});
    const DecodePlan plan = plan_on(dev, s, workspace.view(), split);
    for (const DecodeProblem& layer : layers) {
      SCOPED_TRACE(layer.spec.name() + " split " + std::to_string(split));
      ASSERT_EQ(layer.cache_storage.nbytes(), layers[0].cache_storage.nbytes());
      dev.q.upload(layer.q);
      dev.cache_storage.upload(layer.cache_storage);
      dev.block_table.upload(layer.block_table);
      dev.out.fill_bytes(0xFF);
      dev.lse.fill_bytes(0xFF);
      run_on_plan(plan, dev, s);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const DecodeResult planned = dev.download();
      expect_matches(planned, run_reference(layer), layer.spec);
      if (split == 0) {  // the balanced plan is mla_decode's: the same bits
        dev.out.fill_bytes(0xFF);
        dev.lse.fill_bytes(0xFF);
        dev.run(s);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const DecodeResult direct = dev.download();
        EXPECT_TRUE(bitwise_equal(planned.out, direct.out));
        EXPECT_TRUE(bitwise_equal(planned.lse, direct.lse));
      }
    }
  }
}

// The plan and two layers captured in one graph, replayed with new lengths, pages and queries.
TEST_P(DecodePlanGpu, PlanAndLayersInACudaGraph) {
  const int64_t B = 8;
  std::vector<DecodeProblem> batches;
  for (int i = 0; i < 3; ++i) {
    std::mt19937_64 rng(seed() + i);
    std::vector<int32_t> lens = random_lengths(rng, B, 1, 5000);
    lens[0] = 5000;  // the same table width and pool size for every batch
    int64_t pages = 0;
    for (int32_t l : lens) pages += (l + 63) / 64;
    DecodeProblemSpec s = spec_with(dtype(), B, 16, 1, lens, seed() + i);
    s.spare_pages = 700 - pages;
    s.table_pad_pages = 2;
    batches.push_back(make_decode_problem(s));
  }
  const DecodeProblemSpec& s0 = batches[0].spec;
  DeviceProblem dev(batches[0]);
  DeviceTensor out2(DType::kBFloat16, {B, 1, s0.heads, kLatentDim}), lse2(DType::kFloat32, {B, 1, s0.heads});
  CapturedGraph graph;
  const Stream st = graph.handle();
  ASSERT_EQ(graph.capture([&] {
    const DecodePlan plan = plan_on(dev, s0, dev.workspace.view(), 0, st);
    run_on_plan(plan, dev, s0, st);
    mla_decode_with_plan(plan, dev.q.view(), dev.kv_cache, dev.block_table.view(), dev.seq_lens.view(),
                         out2.view(), lse2.view(), s0.softmax_scale, s0.output_scale, st);
  }), "");
  ASSERT_EQ(graph.ended(), cudaSuccess);
  for (const DecodeProblem& pb : batches) {
    const DecodeResult ref = run_reference(pb);
    ASSERT_EQ(pb.cache_storage.nbytes(), batches[0].cache_storage.nbytes());
    dev.upload(pb);
    for (DeviceTensor* t : {&dev.out, &dev.lse, &out2, &lse2}) t->fill_bytes(0xFF);
    ASSERT_EQ(graph.replay(), cudaSuccess);
    expect_matches(dev.download(), ref, pb.spec);
    expect_matches({out2.to_host(), lse2.to_host()}, ref, pb.spec);
  }
}

// One request (row `target` of a batch) decoded in batches of other sizes and companions: the
// whole batch, the request alone, and the rows from `target - 1` on. The batch-invariant plan must
// give it the same bits in each; the balanced plan cuts it where the batch's balance falls.
struct Placement {
  const char* name;
  int64_t first, count;
};

TEST_P(DecodePlanGpu, BatchInvariantPlanGivesARequestTheSameBitsInAnyBatch) {
  constexpr int64_t B = 9, kTarget = 3, kHeads = 16;
  std::mt19937_64 rng(seed());
  std::vector<int32_t> lens = random_lengths(rng, B, 6000, 30000);
  lens[kTarget] = 20011;  // 20 pieces of 1024 tokens (the last one partial), 5 of 4096
  const DecodeProblem pb = make_decode_problem(spec_with(dtype(), B, kHeads, 1, lens, seed()));
  const DecodeProblemSpec& s = pb.spec;
  const DecodeResult ref = run_reference(pb);
  DeviceProblem dev(pb);
  const int64_t max_tokens = dev.block_table.view().shape[1] * s.page_size;
  const Placement placements[] = {{"whole batch", 0, B}, {"alone", kTarget, 1}, {"from target - 1", kTarget - 1, B - kTarget + 1}};

  for (int64_t split : {int64_t{0}, int64_t{1024}, kDefaultInvariantSplitTokens}) {
    std::vector<DecodeResult> results;
    for (const Placement& at : placements) {
      SCOPED_TRACE(std::string(at.name) + ", split " + std::to_string(split));
      const TensorView seq_lens = rows_of(dev.seq_lens.view(), at.first, at.count);
      const TensorView table = rows_of(dev.block_table.view(), at.first, at.count);
      DeviceTensor out(DType::kBFloat16, {at.count, 1, kHeads, kLatentDim}), lse(DType::kFloat32, {at.count, 1, kHeads});
      DeviceTensor workspace(DType::kUInt8, {static_cast<int64_t>(mla_decode_workspace_size(
                                                at.count, kHeads, 1, device_sm_count(0), max_tokens, split))});
      out.fill_bytes(0xFF);
      lse.fill_bytes(0xFF);
      const DecodePlan plan =
          mla_decode_plan(seq_lens, table, kHeads, 1, s.dtype, s.page_size, workspace.view(), split);
      mla_decode_with_plan(plan, rows_of(dev.q.view(), at.first, at.count), dev.kv_cache, table, seq_lens,
                           out.view(), lse.view(), s.softmax_scale, s.output_scale);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      results.push_back({out.to_host(), lse.to_host()});
      if (at.count == B) expect_matches(results.back(), ref, s);  // correct, not only repeatable
    }
    // The target's row in each result: its out [1, H, 512] BF16 and lse [1, H] FP32 bytes.
    auto target_bytes = [&](const HostTensor& t, size_t row_bytes, size_t placement) {
      const auto* base = static_cast<const char*>(t.view().data);
      return std::vector<char>(base + (kTarget - placements[placement].first) * row_bytes,
                               base + (kTarget - placements[placement].first + 1) * row_bytes);
    };
    const size_t out_row = kHeads * kLatentDim * 2, lse_row = kHeads * 4;
    int differing = 0;
    for (size_t i = 1; i < std::size(placements); ++i) {
      const bool same = target_bytes(results[i].out, out_row, i) == target_bytes(results[0].out, out_row, 0) &&
                        target_bytes(results[i].lse, lse_row, i) == target_bytes(results[0].lse, lse_row, 0);
      differing += !same;
      if (split > 0) {
        EXPECT_TRUE(same) << "split " << split << ": request " << kTarget << " " << placements[i].name
                          << " differs from the whole batch's";
      }
    }
    std::printf("[ invariance ] %s split %lld: the target's bits differ from the whole batch's in %d of %zu "
                "other batches\n", dtype_name(s.dtype), static_cast<long long>(split), differing,
                std::size(placements) - 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Types, DecodePlanGpu, ::testing::Values(DType::kFloat8E4M3, DType::kBFloat16),
                         DtypeParamName());

}  // namespace
}  // namespace speedmla::test
