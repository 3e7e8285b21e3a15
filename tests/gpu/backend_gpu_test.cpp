// MlaBackend on a CUDA device: the metadata kernels against the host rule, decode through the
// backend against the same steps on the CPU device (the reference), a CUDA graph captured once
// and replayed with three different batches, the workspace refusing to grow during capture,
// decode on two streams at once (each backend and stream has its own workspace), and a backend
// made while the legacy stream is busy.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/captured_graph.h"
#include "common/decode_problem.h"
#include "common/error_budget.h"
#include "common/util.h"
#include "cpu/backend_testing.h"
#include "speedmla/backend.h"
#include "speedmla/error.h"

namespace speedmla::test {
namespace {

Device current_gpu() {
  int device = 0;
  cudaGetDevice(&device);
  return Device{DeviceKind::kCUDA, device};
}

// A contiguous device view copied to the host (waits for the device).
HostTensor download(const TensorView& view) {
  HostTensor host(view.dtype, std::vector<int64_t>(view.shape.begin(), view.shape.begin() + view.ndim));
  EXPECT_TRUE(view.is_contiguous());
  EXPECT_EQ(cudaMemcpy(host.view().data, view.data, host.nbytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

TEST(BackendGpu, BlockTablesFollowTheHostRule) {
  SPEEDMLA_REQUIRE_GPU();
  MlaBackend backend(small_config(current_gpu()));
  const int64_t width = backend.block_table_width();
  const DeviceTensor req_to_page(numbered_req_to_page(5, 4));
  const DeviceTensor seq_lens(int_tensor(DType::kInt32, {3, 70, 1, 9}));
  const std::vector<int64_t> pool{4, -1, 2, 99};
  for (DType index_type : {DType::kInt32, DType::kInt64}) {
    const DeviceTensor indices(int_tensor(index_type, pool));
    backend.init_forward_metadata(4, 0, indices.view(), seq_lens.view(), ForwardMode::kDecode,
                                  req_to_page.view(), std::nullopt);
    EXPECT_EQ(int_values(download(backend.decode_metadata()->block_table).view()),
              expected_block_table(pool, 5, 4, width, 4));
  }
  // Graph replay: rows past num_real are padding, whatever their pool indices say.
  backend.init_cuda_graph_state(4, seq_lens.view());
  backend.init_forward_metadata_capture_cuda_graph(4);
  const DeviceTensor indices(int_tensor(DType::kInt64, {1, 3, 0, 0}));
  backend.init_forward_metadata_replay_cuda_graph(4, indices.view(), req_to_page.view(), 2);
  EXPECT_EQ(int_values(download(backend.decode_metadata()->block_table).view()),
            expected_block_table({1, 3, 0, 0}, 5, 4, width, 2));
}

// A backend zero-fills its block-table storage when it is made. That fill once ran on the
// legacy default stream, which a non-blocking stream does not wait for: an engine that made a
// backend and at once built metadata on its own stream could have the fill land afterwards and
// wipe rows of the table (seen on the H200 under load: one request's row all page 0, its
// output 0). Here the legacy stream is held busy by a host function while the backend is made
// and its first table is built on a non-blocking stream; the table must hold once everything
// has run.
TEST(BackendGpu, ConstructionFillIsDoneBeforeWorkOnOtherStreams) {
  SPEEDMLA_REQUIRE_GPU();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const DeviceTensor req_to_page(numbered_req_to_page(5, 4));
  const DeviceTensor seq_lens(int_tensor(DType::kInt32, {3, 70, 1, 9}));
  const std::vector<int64_t> pool{4, 0, 2, 1};
  const DeviceTensor indices(int_tensor(DType::kInt64, pool));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the uploads above ran on the legacy stream
  // Twice: the first time in a process, the driver's own set-up (of the host-function thread,
  // of the allocation) can happen to order the fill first (seen on the H200); later it does not.
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto hold = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); };
    ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, hold, nullptr), cudaSuccess);
    MlaBackend backend(small_config(current_gpu()));
    backend.init_forward_metadata(4, 0, indices.view(), seq_lens.view(), ForwardMode::kDecode, req_to_page.view(),
                                  std::nullopt, stream);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(int_values(download(backend.decode_metadata()->block_table).view()),
              expected_block_table(pool, 5, 4, backend.block_table_width(), 4))
        << "attempt " << attempt;
  }
  cudaStreamDestroy(stream);
}

TEST(BackendGpu, ExtendSlotListsFollowThePageTable) {
  SPEEDMLA_REQUIRE_GPU();
  MlaBackendConfig config = small_config(current_gpu());
  config.page_size = 8;
  config.chunked_prefill_capacity = 8;  // 4 prefix tokens per request per loop
  MlaBackend backend(config);
  const int64_t width = backend.block_table_width();
  HostTensor table(DType::kInt32, {2, width});  // request 0 = pool row 1: pages 7, 3; request 1: page 5
  table.data<int32_t>()[0] = 5;
  table.data<int32_t>()[width] = 7;
  table.data<int32_t>()[width + 1] = 3;
  const DeviceTensor req_to_page(table), pool(int_tensor(DType::kInt64, {1, 0}));
  const DeviceTensor seq_lens(int_tensor(DType::kInt32, {12, 8}));
  const HostTensor prefix = int_tensor(DType::kInt32, {10, 3}), fresh = int_tensor(DType::kInt32, {2, 5});
  backend.init_forward_metadata(2, 2, pool.view(), seq_lens.view(), ForwardMode::kExtend,
                                req_to_page.view(), MlaBackend::ExtendLens{prefix.view(), fresh.view()});
  const ExtendMetadata* md = backend.extend_metadata();
  ASSERT_NE(md, nullptr);
  ASSERT_EQ(md->chunks.num_loops, 3);
  EXPECT_EQ(int_values(download(md->cu_seq_lens).view()), (std::vector<int64_t>{0, 12, 20}));
  EXPECT_EQ(int_values(download(md->cu_extend_seq_lens).view()), (std::vector<int64_t>{0, 2, 7}));
  EXPECT_EQ(int_values(download(md->chunk_cu_seq_lens[1]).view()), (std::vector<int64_t>{0, 4, 4}));
  EXPECT_EQ(int_values(download(md->chunk_slots[0]).view()), (std::vector<int64_t>{56, 57, 58, 59, 40, 41, 42}));
  EXPECT_EQ(int_values(download(md->chunk_slots[1]).view()), (std::vector<int64_t>{60, 61, 62, 63}));
  EXPECT_EQ(int_values(download(md->chunk_slots[2]).view()), (std::vector<int64_t>{24, 25}));
}

// A decode batch held on the host and on the GPU: request r uses pool row r; pool row p owns
// pages 1 + 4p .. 4 + 4p (page 0 is the null page); page size 16, 4 heads.
struct DecodeData {
  static constexpr int64_t kPool = 4, kHeads = 4, kPage = 16;
  HostTensor cache, req_to_page;

  DecodeData(DType dtype, std::mt19937_64& rng)
      : cache(dtype, {1 + 4 * kPool, kPage, 576}), req_to_page(DType::kInt32, {kPool, 4}) {
    fill_uniform(cache, rng, -1.0, 1.0);
    for (int64_t p = 0; p < kPool; ++p)
      for (int64_t i = 0; i < 4; ++i) req_to_page.data<int32_t>()[p * 4 + i] = static_cast<int32_t>(1 + 4 * p + i);
  }
};

MlaBackendConfig decode_config(DType dtype, Device device) {
  MlaBackendConfig config = small_config(device);
  config.page_size = DecodeData::kPage;
  config.context_len = 64;
  config.kv_cache_dtype = dtype;
  config.num_draft_tokens = 2;
  return config;
}

TEST(BackendGpu, DecodeStepMatchesTheCpuBackend) {
  SPEEDMLA_REQUIRE_GPU();
  std::mt19937_64 rng(5);
  for (DType dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    const DecodeData data(dtype, rng);
    const int64_t bs = 3, q_len = 2, tokens = bs * q_len, heads = DecodeData::kHeads;
    const HostTensor pool = int_tensor(DType::kInt64, {2, 0, 3});
    const HostTensor seq_lens = int_tensor(DType::kInt32, {33, 2, 64});
    HostTensor q(DType::kBFloat16, {tokens, heads, 576}), new_kv(DType::kBFloat16, {tokens, 1, 576});
    fill_uniform(q, rng, -1.0, 1.0);
    fill_uniform(new_kv, rng, -1.0, 1.0);
    // The new tokens are the last two positions of every request.
    std::vector<int64_t> slot_values;
    for (int64_t r = 0; r < bs; ++r)
      for (int64_t pos = seq_lens.data<int32_t>()[r] - q_len; pos < seq_lens.data<int32_t>()[r]; ++pos)
        slot_values.push_back(data.req_to_page.data<int32_t>()[pool.data<int64_t>()[r] * 4 + pos / 16] * 16 + pos % 16);
    const HostTensor slots = int_tensor(DType::kInt64, slot_values);

    // The CPU backend: the reference.
    HostTensor cpu_cache(dtype, {1 + 4 * DecodeData::kPool, 16, 576});
    std::memcpy(cpu_cache.view().data, data.cache.view().data, data.cache.nbytes());
    MlaBackend cpu(decode_config(dtype, Device{}));
    cpu.init_forward_metadata(bs, 0, pool.view(), seq_lens.view(), ForwardMode::kDecode, data.req_to_page.view(),
                              std::nullopt);
    HostTensor expected(DType::kBFloat16, {tokens, heads, 512});
    cpu.forward_decode(q.view(), cpu_cache.view(), bs, expected.view(), 0.05f, 0.75f,
                       NewTokenKv{new_kv.view(), slots.view()});

    MlaBackend gpu(decode_config(dtype, current_gpu()));
    DeviceTensor d_cache(data.cache), d_table(data.req_to_page), d_pool(pool), d_lens(seq_lens), d_q(q),
        d_new(new_kv), d_slots(slots), d_out(DType::kBFloat16, {tokens, heads, 512});
    d_out.fill_bytes(0xFF);
    gpu.init_forward_metadata(bs, 0, d_pool.view(), d_lens.view(), ForwardMode::kDecode, d_table.view(),
                              std::nullopt);
    gpu.forward_decode(d_q.view(), d_cache.view(), bs, d_out.view(), 0.05f, 0.75f,
                       NewTokenKv{d_new.view(), d_slots.view()});
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const HostTensor gpu_cache = d_cache.to_host();
    EXPECT_EQ(std::memcmp(gpu_cache.view().data, cpu_cache.view().data, cpu_cache.nbytes()), 0)
        << dtype_name(dtype) << ": the KV write must be bit-exact";
    const ErrorStats err = compare(d_out.to_host(), expected);
    EXPECT_EQ(err.nonfinite, 0) << dtype_name(dtype);
    EXPECT_LT(err.rel_l2, decode_bounds(dtype).out_rel_l2) << dtype_name(dtype) << " " << err.summary();
  }
}

TEST(BackendGpu, CapturedGraphReplaysWithThreeBatches) {
  SPEEDMLA_REQUIRE_GPU();
  std::mt19937_64 rng(6);
  const DType dtype = DType::kFloat8E4M3;
  const DecodeData data(dtype, rng);
  const int64_t graph_bs = 4, heads = DecodeData::kHeads;
  MlaBackend backend(decode_config(dtype, current_gpu()));
  DeviceTensor d_cache(data.cache), d_table(data.req_to_page);
  DeviceTensor d_lens(DType::kInt32, {graph_bs}), d_pool(DType::kInt64, {graph_bs});
  DeviceTensor d_q(DType::kBFloat16, {graph_bs, heads, 576}), d_out(DType::kBFloat16, {graph_bs, heads, 512});
  backend.init_cuda_graph_state(graph_bs, d_lens.view());

  backend.init_forward_metadata_capture_cuda_graph(graph_bs);
  CapturedGraph graph;
  ASSERT_EQ(graph.capture([&] {
    backend.forward_decode(d_q.view(), d_cache.view(), graph_bs, d_out.view(), 0.05f, 1.0f, std::nullopt,
                           std::nullopt, graph.handle());
  }), "");
  ASSERT_EQ(graph.ended(), cudaSuccess);

  MlaBackend cpu(decode_config(dtype, Device{}));
  const std::vector<std::vector<int64_t>> pools{{3, 1}, {0, 2, 1, 3}, {2, 2, 0}};
  const std::vector<std::vector<int64_t>> lengths{{64, 17}, {1, 40, 63, 8}, {16, 33, 5}};
  for (size_t step = 0; step < pools.size(); ++step) {
    const auto real = static_cast<int64_t>(pools[step].size());
    // The engine pads the batch: pool index 0 (any), seq_len = the fill value.
    std::vector<int64_t> pool = pools[step], lens = lengths[step];
    pool.resize(graph_bs, 0);
    lens.resize(graph_bs, MlaBackend::cuda_graph_seq_len_fill_value());
    const HostTensor h_pool = int_tensor(DType::kInt64, pool), h_lens = int_tensor(DType::kInt32, lens);
    HostTensor q(DType::kBFloat16, {graph_bs, heads, 576});
    fill_uniform(q, rng, -1.0, 1.0);
    d_pool.upload(h_pool);
    d_lens.upload(h_lens);
    d_q.upload(q);
    d_out.fill_bytes(0xFF);
    backend.init_forward_metadata_replay_cuda_graph(graph_bs, d_pool.view(), d_table.view(), real,
                                                    ForwardMode::kDecode, graph.handle());
    ASSERT_EQ(graph.replay(), cudaSuccess);

    HostTensor expected(DType::kBFloat16, {real, heads, 512}), got(DType::kBFloat16, {real, heads, 512});
    cpu.init_forward_metadata(real, 0, h_pool.view(), h_lens.view(), ForwardMode::kDecode,
                              data.req_to_page.view(), std::nullopt);
    HostTensor q_real(DType::kBFloat16, {real, heads, 576});
    std::memcpy(q_real.view().data, q.view().data, q_real.nbytes());
    cpu.forward_decode(q_real.view(), data.cache.view(), real, expected.view(), 0.05f);
    const HostTensor out = d_out.to_host();
    std::memcpy(got.view().data, out.view().data, got.nbytes());
    const ErrorStats err = compare(got, expected);
    EXPECT_EQ(err.nonfinite, 0) << "step " << step;
    EXPECT_LT(err.rel_l2, decode_bounds(dtype).out_rel_l2) << "step " << step << " " << err.summary();
    for (int64_t i = got.numel(); i < out.numel(); ++i)  // padded rows: one key, finite
      ASSERT_TRUE(std::isfinite(get(out, i))) << "padded row element " << i;
  }
}

TEST(BackendGpu, WorkspaceDoesNotGrowDuringCapture) {
  SPEEDMLA_REQUIRE_GPU();
  MlaBackendConfig config = decode_config(DType::kFloat8E4M3, current_gpu());
  MlaBackend backend(config);
  const int64_t rows = std::max(config.max_batch, config.max_graph_batch);
  const int64_t q_len = 4;
  std::mt19937_64 rng(7);
  const DecodeData data(DType::kFloat8E4M3, rng);
  DeviceTensor d_cache(data.cache), d_table(data.req_to_page);
  const DeviceTensor d_pool(int_tensor(DType::kInt64, {0})), d_lens(int_tensor(DType::kInt32, {64}));
  backend.init_forward_metadata(1, 0, d_pool.view(), d_lens.view(), ForwardMode::kDecode, d_table.view(),
                                std::nullopt);
  DeviceTensor d_q(DType::kBFloat16, {q_len, DecodeData::kHeads, 576});
  DeviceTensor d_out(DType::kBFloat16, {q_len, DecodeData::kHeads, 512});
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // A stream's first eager call has no workspace yet: inside capture it cannot get one.
  ASSERT_EQ(backend.workspace_capacity(stream), 0u);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string message;
  try {
    backend.forward_decode(d_q.view(), d_cache.view(), 1, d_out.view(), 0.05f, 1.0f, std::nullopt,
                           std::nullopt, stream);
  } catch (const Error& e) {
    message = e.what();
  }
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  if (graph) cudaGraphDestroy(graph);
  EXPECT_NE(message.find("cannot grow during CUDA-graph capture"), std::string::npos) << message;
  EXPECT_EQ(backend.workspace_capacity(stream), 0u);
  // Outside capture the same call grows the workspace and runs.
  backend.forward_decode(d_q.view(), d_cache.view(), 1, d_out.view(), 0.05f, 1.0f, std::nullopt,
                         std::nullopt, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(backend.workspace_capacity(stream), backend.workspace_bytes(rows, q_len));
  cudaStreamDestroy(stream);
}

// Decode of two different batches at the same time, on two streams: by two backends (a target
// and a draft model), and by one backend (the same metadata, other queries). Long sequences on
// few requests, so the plans split requests and partial results go through the workspace;
// twenty rounds queued back to back on both streams before one synchronisation, so the two
// streams' kernels overlap. With one workspace shared by both, one stream's planner rewrote the
// other's plans and partials while its kernels ran.
TEST(BackendGpu, TwoStreamsDecodeConcurrentlyEachAgainstTheReference) {
  SPEEDMLA_REQUIRE_GPU();
  const uint64_t seed = test_seed();
  constexpr int64_t kBatch = 4, kHeads = 16, kRounds = 20;
  constexpr float kScaling = 0.0416667f;
  MlaBackendConfig config;
  config.num_heads = kHeads;
  config.page_size = 64;
  config.kv_cache_dtype = DType::kBFloat16;
  config.context_len = 16384;
  config.max_batch = kBatch;
  config.device = current_gpu();

  // A batch: the problem's block table serves as the engine's req_to_page (pool row = request).
  struct Batch {
    DecodeProblem pb;
    HostTensor expected;
    DeviceTensor cache, req_to_page, pool, seq_lens, q, out;
  };
  // `queries_seed` != 0: the batch's queries drawn again from it (other outputs, same plans).
  auto make_batch = [&](uint64_t batch_seed, uint64_t queries_seed = 0) {
    std::mt19937_64 rng(batch_seed);
    DecodeProblemSpec spec;
    spec.dtype = DType::kBFloat16;
    spec.batch = kBatch;
    spec.heads = kHeads;
    spec.page_size = 64;
    spec.seq_lens = random_lengths(rng, kBatch, 3000, 16000);
    spec.seed = batch_seed;
    spec.softmax_scale = kScaling;
    Batch b{make_decode_problem(spec), HostTensor(DType::kBFloat16, {kBatch, 1, kHeads, 512}), {}, {}, {}, {}, {}, {}};
    if (queries_seed != 0) {
      std::mt19937_64 queries(queries_seed);
      fill_uniform(b.pb.q, queries, -1.0, 1.0);
    }
    mla_decode(b.pb.q.view(), b.pb.kv_cache, b.pb.block_table.view(), b.pb.seq_lens.view(), b.expected.view(),
               std::nullopt, std::nullopt, kScaling);
    b.cache = DeviceTensor(b.pb.cache_storage);
    b.req_to_page = DeviceTensor(b.pb.block_table);
    b.pool = DeviceTensor(int_tensor(DType::kInt64, {0, 1, 2, 3}));
    b.seq_lens = DeviceTensor(b.pb.seq_lens);
    b.q = DeviceTensor(b.pb.q);
    b.out = DeviceTensor(DType::kBFloat16, {kBatch, 1, kHeads, 512});
    b.out.fill_bytes(0xFF);
    return b;
  };
  auto cache_view = [](const Batch& b) {
    TensorView v = b.pb.kv_cache;
    v.data = b.cache.view().data;
    v.device = b.cache.view().device;
    return v;
  };
  auto expect_matches = [&](const Batch& b, const char* what) {
    const HostTensor got = b.out.to_host();
    for (int64_t r = 0; r < kBatch; ++r) {
      const ErrorStats err = compare_rows(got, b.expected, r, r + 1);
      EXPECT_EQ(err.nonfinite, 0) << what << " request " << r << " seed " << seed;
      EXPECT_LT(err.rel_l2, decode_bounds(DType::kBFloat16).out_rel_l2) << what << " request " << r << " " << err.summary()
                                                            << " seed " << seed;
    }
  };

  cudaStream_t streams[2];
  for (cudaStream_t& s : streams) ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  // kRounds of (x on stream 0 by `first`, y on stream 1 by `second`) queued back to back, one
  // synchronisation, then both against the reference.
  auto run_concurrently = [&](MlaBackend& first, Batch& x, MlaBackend& second, Batch& y, const char* what) {
    for (int round = 0; round < kRounds; ++round) {
      first.forward_decode(x.q.view(), cache_view(x), kBatch, x.out.view(), kScaling, 1.0f, std::nullopt,
                           std::nullopt, streams[0]);
      second.forward_decode(y.q.view(), cache_view(y), kBatch, y.out.view(), kScaling, 1.0f, std::nullopt,
                            std::nullopt, streams[1]);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    expect_matches(x, what);
    expect_matches(y, what);
  };

  // Two backends (a target and its draft model), two batches.
  Batch a = make_batch(seed), b = make_batch(seed + 1);
  // The uploads and poison fills ran on the legacy stream, which the non-blocking streams do
  // not wait for (and a pageable upload may return before its copy lands).
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  MlaBackend target(config), draft(config);
  target.init_forward_metadata(kBatch, 0, a.pool.view(), a.seq_lens.view(), ForwardMode::kDecode,
                               a.req_to_page.view(), std::nullopt, streams[0]);
  draft.init_forward_metadata(kBatch, 0, b.pool.view(), b.seq_lens.view(), ForwardMode::kDecode,
                              b.req_to_page.view(), std::nullopt, streams[1]);
  run_concurrently(target, a, draft, b, "two backends");

  // One backend, one batch's metadata (d is c with other queries): the same plans, other
  // partial results.
  Batch c = make_batch(seed + 2), d = make_batch(seed + 2, seed + 3);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  target.init_forward_metadata(kBatch, 0, c.pool.view(), c.seq_lens.view(), ForwardMode::kDecode,
                               c.req_to_page.view(), std::nullopt, streams[0]);
  ASSERT_EQ(cudaStreamSynchronize(streams[0]), cudaSuccess);  // the block table, before stream 1 reads it
  run_concurrently(target, c, target, d, "one backend, two streams");
  EXPECT_GT(target.workspace_capacity(streams[0]), 0u);
  EXPECT_GT(target.workspace_capacity(streams[1]), 0u);
  for (cudaStream_t s : streams) cudaStreamDestroy(s);
}

}  // namespace
}  // namespace speedmla::test
