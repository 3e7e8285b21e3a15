// Long-running use of MlaBackend on the GPU, as an engine drives it:
//   - one decode step captured in a CUDA graph and replayed 10 000 times, with new pool
//     indices, lengths, page tables, batch sizes and queries every step (through the backend's
//     graph-safe metadata refresh), compared bit for bit at random steps with the same step run
//     eagerly, and at a few steps with the CPU backend;
//   - the graphs' workspace growing while graphs exist: growth during capture is refused, growth
//     outside capture keeps the replaced buffer alive, so graphs captured before it still replay
//     correctly next to graphs captured after it.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/error_budget.h"
#include "common/op_testing.h"
#include "common/util.h"
#include "cpu/backend_testing.h"
#include "speedmla/speedmla.h"

namespace speedmla::test {
namespace {

constexpr int64_t kPageSize = 64, kContext = 4096, kPool = 16, kCachePages = 600, kHeads = 16;

Device current_gpu() {
  int device = 0;
  cudaGetDevice(&device);
  return Device{DeviceKind::kCUDA, device};
}

MlaBackendConfig long_run_config(DType dtype, Device device, int64_t draft_tokens = 0) {
  MlaBackendConfig config;
  config.num_heads = kHeads;
  config.tp_size = 1;
  config.page_size = kPageSize;
  config.kv_cache_dtype = dtype;
  config.context_len = kContext;
  config.max_batch = 16;
  config.max_graph_batch = 8;
  config.num_draft_tokens = draft_tokens;
  config.device = device;
  return config;
}

void check(cudaError_t status, const char* what) { ASSERT_EQ(status, cudaSuccess) << what; }

// Copies `host` into the contiguous device view on `stream` (pageable memory: the copy is
// staged before the call returns, so the host buffer may change right after).
void upload_async(const HostTensor& host, const TensorView& device, cudaStream_t stream) {
  ASSERT_EQ(cudaMemcpyAsync(device.data, host.view().data, host.nbytes(), cudaMemcpyHostToDevice, stream),
            cudaSuccess);
}

// The engine's state for one step: pool rows of the real requests (graph padding after them),
// their lengths, and the page table.
struct Step {
  int64_t real = 0;
  HostTensor pool{DType::kInt64, {1}}, lens{DType::kInt32, {1}};
};

Step random_step(std::mt19937_64& rng, int64_t bs, HostTensor& req_to_page) {
  Step s;
  s.real = std::uniform_int_distribution<int64_t>(1, bs)(rng);
  std::vector<int64_t> rows(kPool);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  s.pool = HostTensor(DType::kInt64, {bs});
  s.lens = HostTensor(DType::kInt32, {bs});
  for (int64_t r = 0; r < bs; ++r) {
    const bool real = r < s.real;
    s.pool.data<int64_t>()[r] = real ? rows[r] : 0;
    // Log-uniform lengths: single pages and whole contexts both show up.
    const double u = std::uniform_real_distribution<double>(0, std::log(double(kContext)))(rng);
    s.lens.data<int32_t>()[r] = real ? std::max(1, static_cast<int>(std::exp(u))) : MlaBackend::cuda_graph_seq_len_fill_value();
  }
  // Two pool rows get new pages every step (as requests finish and others start).
  const int64_t width = req_to_page.view().shape[1];
  for (int k = 0; k < 2; ++k) {
    const int64_t row = std::uniform_int_distribution<int64_t>(0, kPool - 1)(rng);
    for (int64_t i = 0; i < width; ++i)
      req_to_page.data<int32_t>()[row * width + i] = std::uniform_int_distribution<int32_t>(1, kCachePages - 1)(rng);
  }
  return s;
}

// The real rows of `out` [bs * q_len, H, 512].
HostTensor real_rows(const HostTensor& out, int64_t real, int64_t q_len) {
  HostTensor t(DType::kBFloat16, {real * q_len, kHeads, kLatentDim});
  std::memcpy(t.view().data, out.view().data, t.nbytes());
  return t;
}

// The engine's cache (random rows) and page table (every entry a page of the cache but the null
// page), on the host.
struct EngineMemory {
  HostTensor cache, req_to_page;
  EngineMemory(DType dtype, int64_t width, std::mt19937_64& rng)
      : cache(dtype, {kCachePages, kPageSize, kCacheRowDim}), req_to_page(DType::kInt32, {kPool, width}) {
    fill_uniform(cache, rng, -1.0, 1.0);
    for (int64_t i = 0; i < req_to_page.numel(); ++i)
      req_to_page.data<int32_t>()[i] = std::uniform_int_distribution<int32_t>(1, kCachePages - 1)(rng);
  }
};

// The same step on the CPU backend (the reference), real rows only.
HostTensor cpu_step(DType dtype, const Step& s, const HostTensor& req_to_page, const HostTensor& cache,
                    const HostTensor& q, int64_t q_len, float scaling) {
  MlaBackend cpu(long_run_config(dtype, Device{}, q_len > 1 ? q_len : 0));
  HostTensor pool(DType::kInt64, {s.real}), lens(DType::kInt32, {s.real});
  std::memcpy(pool.view().data, s.pool.view().data, pool.nbytes());
  std::memcpy(lens.view().data, s.lens.view().data, lens.nbytes());
  cpu.init_forward_metadata(s.real, 0, pool.view(), lens.view(), ForwardMode::kDecode, req_to_page.view(),
                            std::nullopt);
  HostTensor q_real(DType::kBFloat16, {s.real * q_len, kHeads, kCacheRowDim}), out(DType::kBFloat16, {s.real * q_len, kHeads, kLatentDim});
  std::memcpy(q_real.view().data, q.view().data, q_real.nbytes());
  cpu.forward_decode(q_real.view(), cache.view(), s.real, out.view(), scaling);
  return out;
}

void expect_close_to_cpu(DType dtype, const HostTensor& gpu, const HostTensor& cpu, const std::string& where) {
  const ErrorStats err = compare(gpu, cpu);
  record_error("MlaBackend.forward_decode", dtype, err.rel_l2, err.max_abs, -1);
  EXPECT_EQ(err.nonfinite, 0) << where << " " << err.summary();
  EXPECT_LT(err.rel_l2, decode_bounds(dtype).out_rel_l2) << where << " " << err.summary();
}

class LongRunGpu : public testing::TestWithParam<DType> {
 protected:
  void SetUp() override { SPEEDMLA_REQUIRE_GPU(); }
};

TEST_P(LongRunGpu, TenThousandGraphReplaysWithChangingMetadata) {
  const DType dtype = GetParam();
  std::mt19937_64 rng = case_rng(std::string("graph replays ") + dtype_name(dtype));
  constexpr int64_t kBs = 8, kSteps = 10000, kQVariants = 4;
  constexpr float kScaling = 0.0417f;
  MlaBackend backend(long_run_config(dtype, current_gpu()));
  EngineMemory memory(dtype, backend.block_table_width(), rng);
  const HostTensor& cache = memory.cache;
  HostTensor& req_to_page = memory.req_to_page;
  std::vector<HostTensor> queries;
  for (int64_t v = 0; v < kQVariants; ++v) {
    queries.emplace_back(DType::kBFloat16, std::vector<int64_t>{kBs, kHeads, kCacheRowDim});
    fill_uniform(queries.back(), rng, -1.0, 1.0);
  }
  const DeviceTensor d_cache(cache);
  DeviceTensor d_table(req_to_page), d_pool(DType::kInt64, {kBs}), d_lens(DType::kInt32, {kBs});
  DeviceTensor d_eager_lens(DType::kInt32, {kBs});
  DeviceTensor d_q(DType::kBFloat16, {kBs, kHeads, kCacheRowDim}), d_out(DType::kBFloat16, {kBs, kHeads, kLatentDim});
  DeviceTensor d_eager_out(DType::kBFloat16, {kBs, kHeads, kLatentDim});
  backend.init_cuda_graph_state(kBs, d_lens.view());

  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  backend.init_forward_metadata_capture_cuda_graph(kBs);
  cudaGraph_t graph = nullptr;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  backend.forward_decode(d_q.view(), d_cache.view(), kBs, d_out.view(), kScaling, 1.0f, std::nullopt, std::nullopt,
                         stream);
  check(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

  // Steps compared with the eager call: about one in 200, and with the CPU backend: 5 of them.
  int compared = 0, against_cpu = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    const Step s = random_step(rng, kBs, req_to_page);
    const HostTensor& q = queries[step % kQVariants];
    upload_async(req_to_page, d_table.view(), stream);
    upload_async(s.pool, d_pool.view(), stream);
    upload_async(s.lens, d_lens.view(), stream);
    upload_async(q, d_q.view(), stream);
    backend.init_forward_metadata_replay_cuda_graph(kBs, d_pool.view(), d_table.view(), s.real,
                                                    ForwardMode::kDecode, stream);
    check(cudaGraphLaunch(exec, stream), "graph launch");
    const bool compare_now = step == kSteps - 1 || std::uniform_int_distribution<int>(0, 199)(rng) == 0;
    if (!compare_now) continue;

    // The same step eagerly (same padded batch: the same plan, so the same bits in real rows).
    upload_async(s.lens, d_eager_lens.view(), stream);
    backend.init_forward_metadata(kBs, 0, d_pool.view(), d_eager_lens.view(), ForwardMode::kDecode, d_table.view(),
                                  std::nullopt, stream);
    backend.forward_decode(d_q.view(), d_cache.view(), kBs, d_eager_out.view(), kScaling, 1.0f, std::nullopt,
                           std::nullopt, stream);
    check(cudaStreamSynchronize(stream), "step");
    const HostTensor graph_out = real_rows(d_out.to_host(), s.real, 1);
    const HostTensor eager_out = real_rows(d_eager_out.to_host(), s.real, 1);
    ASSERT_TRUE(bitwise_equal(graph_out, eager_out)) << "replay " << step << " differs from the eager call";
    ++compared;
    if (against_cpu < 5 && (compared % 8 == 1 || step == kSteps - 1)) {
      expect_close_to_cpu(dtype, graph_out, cpu_step(dtype, s, req_to_page, cache, q, 1, kScaling),
                          "replay " + std::to_string(step));
      ++against_cpu;
    }
  }
  check(cudaStreamSynchronize(stream), "last step");
  EXPECT_GE(compared, 20) << "too few replays compared";
  std::printf("[ long run ] %s: %lld replays, %d compared with eager calls, %d with the CPU backend\n",
              dtype_name(dtype), static_cast<long long>(kSteps), compared, against_cpu);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Graph A (q_len 1) exists; the graphs' workspace must grow for q_len 8. Inside capture that is
// refused (no allocation can be captured); a warm-up step outside capture grows it, graph B is
// captured with the new buffer, and A (which still points at the old one, kept alive) and B
// replay alternately with new batches, each matching the CPU backend.
TEST_P(LongRunGpu, GraphWorkspaceGrowsWhileGraphsExist) {
  const DType dtype = GetParam();
  std::mt19937_64 rng = case_rng(std::string("graph workspace growth ") + dtype_name(dtype));
  constexpr int64_t kBs = 4, kLongQ = 8;  // 8x the partial results of q_len 1: must grow
  constexpr float kScaling = 0.0417f;
  MlaBackend backend(long_run_config(dtype, current_gpu()));
  EngineMemory memory(dtype, backend.block_table_width(), rng);
  const HostTensor& cache = memory.cache;
  HostTensor& req_to_page = memory.req_to_page;
  const DeviceTensor d_cache(cache);
  DeviceTensor d_table(req_to_page), d_pool(DType::kInt64, {kBs}), d_lens(DType::kInt32, {kBs});
  DeviceTensor d_q1(DType::kBFloat16, {kBs, kHeads, kCacheRowDim}), d_out1(DType::kBFloat16, {kBs, kHeads, kLatentDim});
  DeviceTensor d_q3(DType::kBFloat16, {kBs * kLongQ, kHeads, kCacheRowDim});
  DeviceTensor d_out3(DType::kBFloat16, {kBs * kLongQ, kHeads, kLatentDim});
  backend.init_cuda_graph_state(kBs, d_lens.view());
  const size_t initial = backend.graph_workspace_capacity();
  {  // seq_lens for the warm-up and the captures
    const HostTensor lens = int_tensor(DType::kInt32, {64, 64, 64, 64});
    d_lens.upload(lens);
    d_pool.upload(int_tensor(DType::kInt64, {0, 1, 2, 3}));
  }
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  auto capture = [&](const DeviceTensor& q, const DeviceTensor& out, cudaGraphExec_t& exec) -> std::string {
    backend.init_forward_metadata_capture_cuda_graph(kBs);
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    std::string error;
    try {
      backend.forward_decode(q.view(), d_cache.view(), kBs, out.view(), kScaling, 1.0f, std::nullopt, std::nullopt,
                             stream);
    } catch (const Error& e) {
      error = e.what();
    }
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    if (error.empty()) EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    if (graph) cudaGraphDestroy(graph);
    return error;
  };
  cudaGraphExec_t exec_a = nullptr, exec_b = nullptr;
  ASSERT_EQ(capture(d_q1, d_out1, exec_a), "");
  EXPECT_EQ(backend.graph_workspace_capacity(), initial) << "graph A fits the buffer init_cuda_graph_state made";

  const std::string refused = capture(d_q3, d_out3, exec_b);
  EXPECT_NE(refused.find("cannot grow during CUDA-graph capture"), std::string::npos) << refused;
  EXPECT_EQ(backend.graph_workspace_capacity(), initial);

  // A warm-up step of the new shape outside capture grows the graphs' buffer.
  backend.init_forward_metadata_capture_cuda_graph(kBs);
  backend.forward_decode(d_q3.view(), d_cache.view(), kBs, d_out3.view(), kScaling, 1.0f, std::nullopt,
                         std::nullopt, stream);
  check(cudaStreamSynchronize(stream), "warm-up");
  EXPECT_GT(backend.graph_workspace_capacity(), initial);
  ASSERT_EQ(capture(d_q3, d_out3, exec_b), "");

  for (int round = 0; round < 6; ++round) {
    const bool long_q = round % 2 == 1;
    const int64_t q_len = long_q ? kLongQ : 1;
    Step s = random_step(rng, kBs, req_to_page);
    HostTensor q(DType::kBFloat16, {kBs * q_len, kHeads, kCacheRowDim});
    fill_uniform(q, rng, -1.0, 1.0);
    // Verify: the draft tokens are in the cache, so real rows hold at least q_len keys.
    for (int64_t r = 0; r < s.real; ++r) s.lens.data<int32_t>()[r] = std::max<int32_t>(s.lens.data<int32_t>()[r], kLongQ);
    upload_async(req_to_page, d_table.view(), stream);
    upload_async(s.pool, d_pool.view(), stream);
    upload_async(s.lens, d_lens.view(), stream);
    upload_async(q, (long_q ? d_q3 : d_q1).view(), stream);
    backend.init_forward_metadata_replay_cuda_graph(kBs, d_pool.view(), d_table.view(), s.real,
                                                    ForwardMode::kDecode, stream);
    check(cudaGraphLaunch(long_q ? exec_b : exec_a, stream), "graph launch");
    check(cudaStreamSynchronize(stream), "replay");
    const HostTensor out = real_rows((long_q ? d_out3 : d_out1).to_host(), s.real, q_len);
    expect_close_to_cpu(dtype, out, cpu_step(dtype, s, req_to_page, cache, q, q_len, kScaling),
                        std::string(long_q ? "graph B" : "graph A") + " round " + std::to_string(round));
  }
  cudaGraphExecDestroy(exec_a);
  cudaGraphExecDestroy(exec_b);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(Types, LongRunGpu, testing::Values(DType::kFloat8E4M3, DType::kBFloat16),
                         DtypeParamName());

}  // namespace
}  // namespace speedmla::test
