// speedmla-host-cost: host time per mla_decode call (outside CUDA graphs an engine pays it for
// every layer of every step). Targets (issue 16): the C++ host path <= 2 us per call; the
// Python call <= 10 us over it (bench/host_cost.py).
//
//   speedmla-host-cost [--calls N] [--rounds N]
//
// (a) validation only, no GPU needed: mla_decode with B = 0 on pretend CUDA views (every
//     argument check of the contract runs, nothing is launched) and on CPU views.
// (b) the full GPU call, when a GPU is present: validation, launch parameters, TMA map and the
//     three launches, a decode-shaped problem (B = 1, H = 16, q_len 1, 64 tokens). Host wall
//     time of --calls back-to-back calls (at most 100: 300 launches stay below the launch
//     queue's depth, so no call waits for the GPU), the stream synchronised after each round,
//     outside the timed region: the figure is what the calling thread spends, not how fast the
//     GPU retires the kernels (an empty dependent launch takes the GPU longer than the host).
//     The same for mla_decode_with_plan on a plan made once before (what each layer after the
//     first pays: the main kernel and the combine, no planner), and for
//     MlaBackend::forward_decode (BF16 queries: with an FP8 cache it quantises them first),
//     whose metadata was built once before, so that every call but the first reuses its plan.
// (c) the floor: three dependent launches of an empty kernel, as the decode call launches.
// Each figure is the best of --rounds rounds, per call.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "launch_floor.h"
#include "speedmla/backend.h"
#include "speedmla/speedmla.h"

namespace {

using namespace speedmla;
using Clock = std::chrono::steady_clock;

void cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

// Best per-call host time in microseconds of `rounds` rounds of `calls` calls; `after_round`
// runs after each round, untimed (the GPU cases drain the stream there).
double time_per_call(int calls, int rounds, const std::function<void()>& call,
                     const std::function<void()>& after_round = [] {}) {
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto start = Clock::now();
    for (int i = 0; i < calls; ++i) call();
    best = std::min(best, std::chrono::duration<double, std::micro>(Clock::now() - start).count() / calls);
    after_round();
  }
  return best;
}

// The tensors of a decode call: B requests of q_len 1, H heads, a 64-page cache of page 64,
// one page per request; at `base` (pretend or real device memory, or host memory).
struct Views {
  TensorView q, kv_cache, block_table, seq_lens, out, lse, workspace;
};

Views views_at(char* base, Device device, int64_t batch, int64_t heads, DType dtype, size_t workspace_bytes) {
  constexpr int64_t kPages = 64, kPageSize = 64, kTablePages = 8;
  const auto esize = static_cast<int64_t>(dtype_size(dtype));
  size_t offset = 0;
  auto next = [&](int64_t bytes) {
    char* p = base + offset;
    offset += (static_cast<size_t>(bytes) + 255) / 256 * 256;
    return p;
  };
  Views v;
  v.kv_cache = make_view(next(kPages * kPageSize * kCacheRowDim * esize), dtype, device, {kPages, kPageSize, kCacheRowDim});
  v.q = make_view(next(batch * heads * kCacheRowDim * esize), dtype, device, {batch, 1, heads, kCacheRowDim});
  v.block_table = make_view(next(batch * kTablePages * 4), DType::kInt32, device, {batch, kTablePages});
  v.seq_lens = make_view(next(batch * 4), DType::kInt32, device, {batch});
  v.out = make_view(next(batch * heads * kLatentDim * 2), DType::kBFloat16, device, {batch, 1, heads, kLatentDim});
  v.lse = make_view(next(batch * heads * 4), DType::kFloat32, device, {batch, 1, heads});
  v.workspace = make_view(next(static_cast<int64_t>(workspace_bytes)), DType::kUInt8, device,
                          {static_cast<int64_t>(workspace_bytes)});
  return v;
}

size_t views_bytes(int64_t batch, int64_t heads, size_t workspace_bytes) {
  return (size_t{64} * 64 * kCacheRowDim * 2 + batch * heads * (kCacheRowDim * 2 + kLatentDim * 2 + 4) +
          batch * (8 * 4 + 4) + workspace_bytes) + 7 * 256;
}

void call(const Views& v, Stream stream = nullptr) {
  mla_decode(v.q, v.kv_cache, v.block_table, v.seq_lens, v.out, v.lse, v.workspace, 0.0416667f, 1.f, stream);
}

DecodePlan plan_of(const Views& v, Stream stream = nullptr) {
  return mla_decode_plan(v.seq_lens, v.block_table, v.q.shape[2], v.q.shape[1], v.q.dtype, v.kv_cache.shape[1],
                         v.workspace, 0, stream);
}

void call_with_plan(const DecodePlan& plan, const Views& v, Stream stream = nullptr) {
  mla_decode_with_plan(plan, v.q, v.kv_cache, v.block_table, v.seq_lens, v.out, v.lse, 0.0416667f, 1.f, stream);
}

}  // namespace

int main(int argc, char** argv) {
  int calls = 200, rounds = 50;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--calls") && i + 1 < argc) calls = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--calls N] [--rounds N]\n", argv[0]);
      return 2;
    }
  }
  std::printf("speedmla-host-cost: best of %d rounds of %d calls, microseconds per call\n", rounds, calls);

  // (a) Validation only: B = 0 at pretend device addresses (never dereferenced), and on the host.
  const Views pretend = views_at(reinterpret_cast<char*>(uintptr_t{1} << 40), Device{DeviceKind::kCUDA, 0}, 0, 16,
                                 DType::kFloat8E4M3, 256);
  std::printf("(a) mla_decode validation only, B=0, CUDA views : %7.3f us\n",
              time_per_call(calls * 10, rounds, [&] { call(pretend); }));
  const DecodePlan pretend_plan = plan_of(pretend);  // B = 0: checked, nothing launched
  std::printf("(a) mla_decode_with_plan validation, B=0, CUDA  : %7.3f us\n",
              time_per_call(calls * 10, rounds, [&] { call_with_plan(pretend_plan, pretend); }));
  std::vector<char> host(views_bytes(0, 16, 256) + 256);
  char* host_base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(host.data()) + 255) / 256 * 256);
  const Views cpu = views_at(host_base, Device{}, 0, 16, DType::kFloat8E4M3, 256);
  std::printf("(a) mla_decode validation only, B=0, CPU views  : %7.3f us\n",
              time_per_call(calls * 10, rounds, [&] { call(cpu); }));

  // (b) The whole GPU call.
  const int gpu_calls = std::min(calls, 100);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("(b) full GPU call: skipped, no CUDA device\n");
    return 0;
  }
  for (DType dtype : {DType::kFloat8E4M3, DType::kBFloat16}) {
    constexpr int64_t kBatch = 1, kHeads = 16;
    const size_t ws = mla_decode_workspace_size(kBatch, kHeads, 1, device_sm_count(0));
    void* memory = nullptr;
    const size_t bytes = views_bytes(kBatch, kHeads, ws);
    cuda(cudaMalloc(&memory, bytes), "cudaMalloc");
    cuda(cudaMemset(memory, 0, bytes), "cudaMemset");  // page 0 everywhere, zero lengths...
    const Views gpu = views_at(static_cast<char*>(memory), Device{DeviceKind::kCUDA, 0}, kBatch, kHeads, dtype, ws);
    const int32_t seq_len = 64, page = 1;  // ...but one full page for the request
    cuda(cudaMemcpy(gpu.seq_lens.data, &seq_len, 4, cudaMemcpyHostToDevice), "seq_lens");
    cuda(cudaMemcpy(gpu.block_table.data, &page, 4, cudaMemcpyHostToDevice), "block_table");
    cudaStream_t stream;
    cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    const auto s = reinterpret_cast<Stream>(stream);
    call(gpu, s);  // first call: opt-in, capability and SM count cached
    cuda(cudaStreamSynchronize(stream), "warm-up");
    const double per_call = time_per_call(gpu_calls, rounds, [&] { call(gpu, s); },
                                          [&] { cuda(cudaStreamSynchronize(stream), "sync"); });
    std::printf("(b) mla_decode full GPU call, %-13s B=1 H=16 : %7.3f us (%d calls per round)\n",
                dtype_name(dtype), per_call, gpu_calls);
    const DecodePlan plan = plan_of(gpu, s);
    const double planned_per_call = time_per_call(gpu_calls, rounds, [&] { call_with_plan(plan, gpu, s); },
                                                  [&] { cuda(cudaStreamSynchronize(stream), "sync"); });
    std::printf("(b) mla_decode_with_plan (plan reused), %-13s : %7.3f us (%d calls per round)\n",
                dtype_name(dtype), planned_per_call, gpu_calls);

    MlaBackendConfig config;
    config.num_heads = kHeads;
    config.page_size = 64;
    config.kv_cache_dtype = dtype;
    config.context_len = 64 * 8;
    config.max_batch = kBatch;
    config.device = Device{DeviceKind::kCUDA, 0};
    MlaBackend backend(config);
    void* meta = nullptr;  // req_to_page [1, 8] (page 1 first), pool index 0, then a BF16 query
    const size_t q_bytes = kHeads * kCacheRowDim * 2;
    cuda(cudaMalloc(&meta, 256 + q_bytes), "cudaMalloc");
    cuda(cudaMemset(meta, 0, 256 + q_bytes), "cudaMemset");
    cuda(cudaMemcpy(meta, &page, 4, cudaMemcpyHostToDevice), "req_to_page");
    auto* bytes_at = static_cast<char*>(meta);
    const TensorView req_to_page = make_view(bytes_at, DType::kInt32, config.device, {1, 8});
    const TensorView pool = make_view(bytes_at + 64, DType::kInt64, config.device, {1});
    const TensorView q_bf16 = make_view(bytes_at + 256, DType::kBFloat16, config.device, {kBatch, kHeads, kCacheRowDim});
    const TensorView out3 = make_view(gpu.out.data, DType::kBFloat16, config.device, {kBatch, kHeads, kLatentDim});
    backend.init_forward_metadata(kBatch, 0, pool, gpu.seq_lens, ForwardMode::kDecode, req_to_page, std::nullopt, s);
    auto forward = [&] { backend.forward_decode(q_bf16, gpu.kv_cache, kBatch, out3, 0.0416667f, 1.f, std::nullopt, std::nullopt, s); };
    forward();
    cuda(cudaStreamSynchronize(stream), "warm-up");
    const double backend_per_call =
        time_per_call(gpu_calls, rounds, forward, [&] { cuda(cudaStreamSynchronize(stream), "sync"); });
    std::printf("(b) MlaBackend::forward_decode, %-13s B=1 H=16 : %7.3f us (%d calls per round)\n",
                dtype_name(dtype), backend_per_call, gpu_calls);
    cuda(cudaFree(meta), "cudaFree");
    cuda(cudaStreamDestroy(stream), "stream");
    cuda(cudaFree(memory), "cudaFree");
  }
  cudaStream_t stream;
  cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cuda(launch_three_empty_kernels(stream), "empty launches");
  cuda(cudaStreamSynchronize(stream), "warm-up");
  const double floor_per_call = time_per_call(
      gpu_calls, rounds, [&] { cuda(launch_three_empty_kernels(stream), "empty launches"); },
      [&] { cuda(cudaStreamSynchronize(stream), "sync"); });
  std::printf("(c) floor: three dependent launches of an empty kernel  : %7.3f us (%d calls per round)\n",
              floor_per_call, gpu_calls);
  const double plain_per_call = time_per_call(
      gpu_calls, rounds, [&] { cuda(launch_three_plain_empty_kernels(stream), "plain empty launches"); },
      [&] { cuda(cudaStreamSynchronize(stream), "sync"); });
  std::printf("(c) floor: three plain <<<>>> launches of an empty kernel: %7.3f us (%d calls per round)\n",
              plain_per_call, gpu_calls);
  cuda(cudaStreamDestroy(stream), "stream");
  return 0;
}
