// MlaBackend metadata on the CPU device: block tables against hand-computed tables, padding,
// mixed batches, CUDA-graph capture/replay bookkeeping, aliasing and num_extends overrides.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend_testing.h"
#include "speedmla/backend.h"
#include "speedmla/error.h"

namespace speedmla::test {
namespace {


TEST(BackendMetadata, DecodeBlockTableByHand) {
  MlaBackend backend(small_config());
  ASSERT_EQ(backend.block_table_width(), 6);
  const HostTensor req_to_page = numbered_req_to_page(4, 4);  // narrower than the table
  const HostTensor pool = int_tensor(DType::kInt64, {2, 0, 3});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {70, 1, 256});
  backend.init_forward_metadata(3, 0, pool.view(), seq_lens.view(), ForwardMode::kDecode,
                                req_to_page.view(), std::nullopt);
  const DecodeMetadata* md = backend.decode_metadata();
  ASSERT_NE(md, nullptr);
  EXPECT_EQ(backend.extend_metadata(), nullptr);
  EXPECT_EQ(md->num_extends, 0);
  EXPECT_EQ(md->max_seq_len, 300);
  EXPECT_EQ(md->block_table.shape_string(), "[3, 6]");
  EXPECT_EQ(int_values(md->block_table), (std::vector<int64_t>{
      201, 202, 203, 204, 0, 0,
      1, 2, 3, 4, 0, 0,
      301, 302, 303, 304, 0, 0}));
  EXPECT_EQ(md->seq_lens.data, seq_lens.view().data);  // aliased, not copied
  EXPECT_EQ(md->seq_lens.shape[0], 3);
}

TEST(BackendMetadata, WidePageTableIsCutAndStridesAreHonoured) {
  MlaBackend backend(small_config());
  // A [3, 10] view inside a [3, 16] buffer: row stride 16, more pages than the table's 6.
  HostTensor buffer = numbered_req_to_page(3, 16);
  TensorView req_to_page = buffer.view();
  req_to_page.shape[1] = 10;
  const HostTensor pool = int_tensor(DType::kInt32, {1, 2});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {5, 5});
  backend.init_forward_metadata(2, 0, pool.view(), seq_lens.view(), ForwardMode::kDecode,
                                req_to_page, std::nullopt);
  EXPECT_EQ(int_values(backend.decode_metadata()->block_table),
            expected_block_table({1, 2}, 3, 10, 6, 2));
}

TEST(BackendMetadata, OutOfRangePoolIndicesGiveTheNullPage) {
  MlaBackend backend(small_config());
  const HostTensor req_to_page = numbered_req_to_page(2, 6);
  const HostTensor pool = int_tensor(DType::kInt64, {-1, 1, 2, 1000});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {1, 1, 1, 1});
  backend.init_forward_metadata(4, 0, pool.view(), seq_lens.view(), ForwardMode::kDecode,
                                req_to_page.view(), std::nullopt);
  EXPECT_EQ(int_values(backend.decode_metadata()->block_table),
            expected_block_table({-1, 1, 2, 1000}, 2, 6, 6, 4));
}

TEST(BackendMetadata, MixedBatchKeepsExtendRowsFirst) {
  MlaBackend backend(small_config());
  const HostTensor req_to_page = numbered_req_to_page(4, 6);
  const HostTensor pool = int_tensor(DType::kInt64, {3, 1, 0});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {20, 9, 65});
  const HostTensor prefix = int_tensor(DType::kInt32, {12});
  const HostTensor fresh = int_tensor(DType::kInt32, {8});
  backend.init_forward_metadata(3, 1, pool.view(), seq_lens.view(), ForwardMode::kMixed,
                                req_to_page.view(),
                                MlaBackend::ExtendLens{prefix.view(), fresh.view()});
  const DecodeMetadata* md = backend.decode_metadata();
  ASSERT_NE(md, nullptr);
  EXPECT_EQ(md->num_extends, 1);
  EXPECT_EQ(int_values(md->block_table), expected_block_table({3, 1, 0}, 4, 6, 6, 3));
  const ExtendMetadata* ext = backend.extend_metadata();
  ASSERT_NE(ext, nullptr);
  EXPECT_EQ(ext->num_extends, 1);
  EXPECT_EQ(int_values(ext->cu_seq_lens), (std::vector<int64_t>{0, 20}));
  EXPECT_EQ(int_values(ext->cu_extend_seq_lens), (std::vector<int64_t>{0, 8}));
  EXPECT_EQ(ext->max_extend_seq_len, 8);
  ASSERT_EQ(ext->chunks.num_loops, 1);
  // Request 0 is pool row 3: page 301 holds positions 0..63.
  std::vector<int64_t> slots;
  for (int64_t pos = 0; pos < 12; ++pos) slots.push_back(301 * 64 + pos);
  EXPECT_EQ(int_values(ext->chunk_slots[0]), slots);
}

TEST(BackendMetadata, ExtendBatchBuildsDecodeMetadataOnlyForADraft) {
  const HostTensor req_to_page = numbered_req_to_page(2, 6);
  const HostTensor pool = int_tensor(DType::kInt32, {0, 1});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {3, 4});
  const HostTensor prefix = int_tensor(DType::kInt32, {0, 0});
  const HostTensor fresh = int_tensor(DType::kInt32, {3, 4});
  const MlaBackend::ExtendLens lens{prefix.view(), fresh.view()};
  for (bool draft : {false, true}) {
    MlaBackendConfig config = small_config();
    config.is_draft = draft;
    MlaBackend backend(config);
    backend.init_forward_metadata(2, 2, pool.view(), seq_lens.view(), ForwardMode::kExtend,
                                  req_to_page.view(), lens);
    ASSERT_NE(backend.extend_metadata(), nullptr);
    EXPECT_EQ(backend.extend_metadata()->chunks.num_loops, 0);
    EXPECT_EQ(backend.decode_metadata() != nullptr, draft);
  }
}

TEST(BackendMetadata, OverrideNumExtendsIsScoped) {
  MlaBackend backend(small_config());
  const HostTensor req_to_page = numbered_req_to_page(3, 6);
  const HostTensor pool = int_tensor(DType::kInt64, {0, 1, 2});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {4, 4, 4});
  const HostTensor prefix = int_tensor(DType::kInt32, {0, 0});
  const HostTensor fresh = int_tensor(DType::kInt32, {4, 4});
  backend.init_forward_metadata(3, 2, pool.view(), seq_lens.view(), ForwardMode::kMixed,
                                req_to_page.view(),
                                MlaBackend::ExtendLens{prefix.view(), fresh.view()});
  {
    auto scope = backend.override_num_extends(0);
    EXPECT_EQ(backend.decode_metadata()->num_extends, 0);
  }
  EXPECT_EQ(backend.decode_metadata()->num_extends, 2);
  expect_error([&] { backend.set_num_extends(4); }, "num_extends must be in [0, bs = 3]");
}

TEST(BackendMetadata, RejectsBadBatches) {
  MlaBackend backend(small_config());
  const HostTensor req_to_page = numbered_req_to_page(2, 6);
  const HostTensor pool = int_tensor(DType::kInt64, {0, 1});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {4, 4});
  auto decode = [&](int64_t bs, int64_t extends, const TensorView& p, const TensorView& s,
                    const TensorView& table, ForwardMode mode = ForwardMode::kDecode) {
    backend.init_forward_metadata(bs, extends, p, s, mode, table, std::nullopt);
  };
  expect_error([&] { decode(5, 0, pool.view(), seq_lens.view(), req_to_page.view()); },
               "bs must be in [1, config.max_batch = 4]");
  expect_error([&] { decode(0, 0, pool.view(), seq_lens.view(), req_to_page.view()); },
               "bs must be in");
  expect_error([&] { decode(2, 1, pool.view(), seq_lens.view(), req_to_page.view()); },
               "a decode batch has no extend requests");
  expect_error([&] { decode(2, 3, pool.view(), seq_lens.view(), req_to_page.view(), ForwardMode::kMixed); },
               "num_extends must be in [0, bs = 2]");
  expect_error([&] { decode(2, 1, pool.view(), seq_lens.view(), req_to_page.view(), ForwardMode::kMixed); },
               "needs the extend requests' host lengths");
  expect_error([&] { decode(3, 0, int_tensor(DType::kInt64, {0, 1, 0}).view(), seq_lens.view(), req_to_page.view()); },
               "seq_lens must hold at least 3 entries");
  expect_error([&] { decode(2, 0, pool.view(), int_tensor(DType::kInt64, {4, 4}).view(), req_to_page.view()); },
               "seq_lens must be int32");
  expect_error([&] { decode(2, 0, int_tensor(DType::kInt64, {0}).view(), seq_lens.view(), req_to_page.view()); },
               "req_pool_indices must hold at least bs = 2 entries");
  HostTensor wide = HostTensor(DType::kInt64, {2, 6});
  expect_error([&] { decode(2, 0, pool.view(), seq_lens.view(), wide.view()); },
               "req_to_page must be int32");
  HostTensor floats(DType::kFloat32, {2});
  expect_error([&] { decode(2, 0, floats.view(), seq_lens.view(), req_to_page.view()); },
               "req_pool_indices must be int32 or int64");
  // Extend lengths: negative, longer than the context, prefix beyond the page table.
  auto extend = [&](const std::vector<int64_t>& prefix, const std::vector<int64_t>& fresh) {
    const HostTensor p = int_tensor(DType::kInt32, prefix), f = int_tensor(DType::kInt32, fresh);
    backend.init_forward_metadata(2, 2, pool.view(), seq_lens.view(), ForwardMode::kExtend,
                                  req_to_page.view(), MlaBackend::ExtendLens{p.view(), f.view()});
  };
  expect_error([&] { extend({-1, 0}, {1, 1}); }, "extend.prefix_lens[0] must be >= 0");
  expect_error([&] { extend({0, 0}, {1, -2}); }, "extend.extend_lens[1] must be >= 0");
  expect_error([&] { extend({200, 0}, {101, 1}); }, "more than config.context_len = 300");
  expect_error([&] { extend({0}, {1}); }, "extend.prefix_lens.shape[0] must be 2");
  const HostTensor narrow = numbered_req_to_page(2, 2);  // 128 tokens per pool row
  expect_error([&] {
    const HostTensor p = int_tensor(DType::kInt32, {129, 0}), f = int_tensor(DType::kInt32, {1, 1});
    backend.init_forward_metadata(2, 2, pool.view(), seq_lens.view(), ForwardMode::kExtend,
                                  narrow.view(), MlaBackend::ExtendLens{p.view(), f.view()});
  }, "req_to_page rows hold only 2 pages");
}

TEST(BackendMetadata, ARefusedBatchKeepsThePreviousMetadata) {
  MlaBackend backend(small_config());
  const HostTensor req_to_page = numbered_req_to_page(3, 6);
  const HostTensor pool = int_tensor(DType::kInt64, {0, 1, 2});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {4, 4, 4});
  const HostTensor prefix = int_tensor(DType::kInt32, {5}), fresh = int_tensor(DType::kInt32, {3});
  backend.init_forward_metadata(3, 1, pool.view(), seq_lens.view(), ForwardMode::kMixed,
                                req_to_page.view(), MlaBackend::ExtendLens{prefix.view(), fresh.view()});
  const HostTensor floats(DType::kFloat32, {3});
  EXPECT_THROW(backend.init_forward_metadata(3, 0, floats.view(), seq_lens.view(), ForwardMode::kDecode,
                                             req_to_page.view(), std::nullopt),
               Error);
  ASSERT_NE(backend.extend_metadata(), nullptr);
  EXPECT_EQ(backend.decode_metadata()->num_extends, 1);
  EXPECT_EQ(int_values(backend.decode_metadata()->block_table), expected_block_table({0, 1, 2}, 3, 6, 6, 3));
}

TEST(BackendGraph, CaptureThenReplayRefreshesInPlace) {
  MlaBackend backend(small_config());
  HostTensor seq_lens_buf = int_tensor(DType::kInt32, {1, 1, 1, 1});
  backend.init_cuda_graph_state(4, seq_lens_buf.view());
  const HostTensor pool = int_tensor(DType::kInt64, {0, 0, 0, 0});
  backend.init_forward_metadata_capture_cuda_graph(2);
  const DecodeMetadata captured = *backend.decode_metadata();
  EXPECT_EQ(captured.block_table.shape_string(), "[2, 6]");
  EXPECT_EQ(int_values(captured.block_table), std::vector<int64_t>(12, 0));  // page 0 until replay
  EXPECT_EQ(captured.seq_lens.data, seq_lens_buf.view().data);
  backend.init_forward_metadata_capture_cuda_graph(3);

  const HostTensor req_to_page = numbered_req_to_page(5, 6);
  const HostTensor batch = int_tensor(DType::kInt64, {4, 2, 99});
  backend.init_forward_metadata_replay_cuda_graph(2, batch.view(), req_to_page.view(), 1);
  const DecodeMetadata* md = backend.decode_metadata();
  EXPECT_EQ(md->block_table.data, captured.block_table.data);  // the captured buffer, refreshed
  EXPECT_EQ(int_values(md->block_table), expected_block_table({4, 2}, 5, 6, 6, 1));
  backend.init_forward_metadata_replay_cuda_graph(3, batch.view(), req_to_page.view());
  EXPECT_EQ(int_values(backend.decode_metadata()->block_table),
            expected_block_table({4, 2, 99}, 5, 6, 6, 3));
  EXPECT_EQ(backend.decode_metadata()->seq_lens.shape[0], 3);
  EXPECT_EQ(MlaBackend::cuda_graph_seq_len_fill_value(), 1);
}

TEST(BackendGraph, RejectsMisuse) {
  MlaBackendConfig no_graphs = small_config();
  no_graphs.max_graph_batch = 0;
  MlaBackend disabled(no_graphs);
  HostTensor buf = int_tensor(DType::kInt32, {1, 1, 1, 1});
  expect_error([&] { disabled.init_cuda_graph_state(2, buf.view()); }, "CUDA graphs are disabled");

  MlaBackend backend(small_config());
  expect_error([&] { backend.init_forward_metadata_capture_cuda_graph(1); }, "call init_cuda_graph_state first");
  expect_error([&] { backend.init_cuda_graph_state(5, buf.view()); }, "max_bs must be in [1, config.max_graph_batch = 4]");
  HostTensor short_buf = int_tensor(DType::kInt32, {1});
  expect_error([&] { backend.init_cuda_graph_state(2, short_buf.view()); }, "seq_lens_buf must hold at least 2 entries");
  backend.init_cuda_graph_state(2, buf.view());
  expect_error([&] { backend.init_forward_metadata_capture_cuda_graph(3); }, "bs must be in [1, max_bs = 2]");
  expect_error([&] { backend.init_forward_metadata_capture_cuda_graph(1, ForwardMode::kExtend); },
               "CUDA graphs cover decode and verify only");
  const HostTensor pool = int_tensor(DType::kInt64, {0, 0});
  const HostTensor req_to_page = numbered_req_to_page(1, 6);
  expect_error([&] { backend.init_forward_metadata_replay_cuda_graph(1, pool.view(), req_to_page.view()); },
               "no graph was captured for batch size 1");
  backend.init_forward_metadata_capture_cuda_graph(2);
  expect_error([&] { backend.init_forward_metadata_replay_cuda_graph(2, pool.view(), req_to_page.view(), 3); },
               "num_real must be <= bs = 2");
}

TEST(BackendGraph, DraftAliasesTargetBlockTable) {
  MlaBackend target(small_config());
  MlaBackendConfig draft_config = small_config();
  draft_config.is_draft = true;
  MlaBackend draft(draft_config);
  HostTensor target_lens = int_tensor(DType::kInt32, {1, 1, 1, 1});
  HostTensor draft_lens = int_tensor(DType::kInt32, {1, 1, 1, 1});
  target.init_cuda_graph_state(4, target_lens.view());
  draft.init_cuda_graph_state(4, draft_lens.view());
  expect_error([&] { target.alias_cuda_graph_block_table(draft); }, "only a draft backend");
  draft.alias_cuda_graph_block_table(target);
  target.init_forward_metadata_capture_cuda_graph(2);
  draft.init_forward_metadata_capture_cuda_graph(2);
  EXPECT_EQ(draft.decode_metadata()->block_table.data, target.decode_metadata()->block_table.data);
  EXPECT_EQ(draft.decode_metadata()->seq_lens.data, draft_lens.view().data);  // its own lengths

  const HostTensor req_to_page = numbered_req_to_page(3, 6);
  const HostTensor pool = int_tensor(DType::kInt64, {2, 1});
  target.init_forward_metadata_replay_cuda_graph(2, pool.view(), req_to_page.view());
  const HostTensor other = int_tensor(DType::kInt64, {0, 0});
  draft.init_forward_metadata_replay_cuda_graph(2, other.view(), req_to_page.view());  // no refresh
  EXPECT_EQ(int_values(draft.decode_metadata()->block_table),
            expected_block_table({2, 1}, 3, 6, 6, 2));

  MlaBackendConfig late_config = draft_config;
  MlaBackend late(late_config);
  late.init_cuda_graph_state(2, draft_lens.view());
  late.init_forward_metadata_capture_cuda_graph(1);
  expect_error([&] { late.alias_cuda_graph_block_table(target); }, "alias before capturing");
  MlaBackendConfig other_page = draft_config;
  other_page.page_size = 32;
  MlaBackend mismatched(other_page);
  mismatched.init_cuda_graph_state(2, draft_lens.view());
  expect_error([&] { mismatched.alias_cuda_graph_block_table(target); }, "same page size and width");
}

}  // namespace
}  // namespace speedmla::test
