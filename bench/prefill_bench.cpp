// speedmla-bench --prefill: mla_prefill on `batch` requests of equal length (queries = keys),
// q [B·len, H, 192], k [B·len, H, 192], v [B·len, H, 128] of normal data (std 1) in the case's
// dtype, out BF16 and lse FP32. Each timed call: a 256 MB buffer written first (the L2 holds 60
// MB, so nothing the call reads is cached), CUDA events around mla_prefill alone, median of
// --iters calls after 3 untimed ones. TFLOP/s by the prefill formula of performance.md; the SM
// clock, power and throttle reasons are sampled from nvidia-smi while the case runs. The cuDNN
// column is performance.md's table (another day, another run): bench/prefill_peer.py times cuDNN
// beside speedmla in one process, which is the comparison that counts.
#include "prefill_bench.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <tuple>

#include "bench_common.h"
#include "speedmla/speedmla.h"

namespace speedmla::bench {
namespace {

constexpr double kFp8Tflops = 1267, kBf16Tflops = 700;  // measured matmul ceilings (performance.md)
constexpr size_t kFlushBytes = size_t{256} << 20;

// cuDNN BF16 attention (d_qk 192, d_v 128, causal) from performance.md, ms by (H, B, len).
const std::map<std::tuple<int, int, int>, double> kCudnnBf16 = {
    {{128, 16, 1024}, 1.43}, {{128, 4, 4096}, 4.64}, {{128, 1, 8192}, 4.23}, {{128, 1, 16384}, 18.57},
    {{128, 1, 32768}, 73.3}, {{16, 4, 4096}, 0.593}, {{16, 1, 16384}, 2.17}};

double prefill_flops(const PrefillCase& c) {
  const double len = c.len;
  const double pairs = c.causal ? len * len - len * (len - 1) / 2 : len * len;
  return 2.0 * c.heads * (kPrefillQkDim + kPrefillVDim) * pairs * c.batch;
}

struct Buffers {
  void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr, *lse = nullptr, *cu = nullptr, *flush = nullptr;
};

}  // namespace

std::vector<PrefillCase> prefill_grid(const std::vector<DType>& dtypes) {
  std::vector<PrefillCase> cases;
  for (DType dtype : dtypes) {
    // FP8 in both value layouts, one right after the other for each shape (alike in clock).
    auto add = [&](int heads, int batch, int len) {
      cases.push_back({dtype, heads, batch, len, true});
      if (dtype == DType::kFloat8E4M3)
        cases.push_back({dtype, heads, batch, len, true, PrefillValueLayout::kFp8Transposed});
    };
    for (auto [batch, len] : {std::pair{16, 1024}, {4, 4096}, {1, 8192}, {1, 16384}, {1, 32768}}) add(128, batch, len);
    for (auto [batch, len] : {std::pair{4, 4096}, {1, 16384}}) add(16, batch, len);
  }
  return cases;
}

bool parse_prefill_case(const char* text, PrefillCase& c) {
  char type[8] = {};
  int causal = 1;
  if (std::sscanf(text, "%7[^,],%d,%d,%d,%d", type, &c.heads, &c.batch, &c.len, &causal) != 5) return false;
  const std::string t = type;
  if ((t != "fp8" && t != "fp8t" && t != "bf16") || c.heads < 1 || c.batch < 1 || c.len < 1) return false;
  c.dtype = t == "bf16" ? DType::kBFloat16 : DType::kFloat8E4M3;
  c.v_layout = t == "fp8t" ? PrefillValueLayout::kFp8Transposed : PrefillValueLayout::kTokenMajor;
  c.causal = causal != 0;
  return true;
}

int run_prefill_cases(const std::vector<PrefillCase>& cases, int iters, int rest_ms) {
  int device = 0;
  cuda(cudaGetDevice(&device), "device");
  const Device dev{DeviceKind::kCUDA, device};
  int64_t max_rows = 0, max_batch = 1, max_heads = 1;  // rows = tokens x heads
  for (const PrefillCase& c : cases) {
    max_rows = std::max<int64_t>(max_rows, int64_t{c.batch} * c.len * c.heads);
    max_batch = std::max<int64_t>(max_batch, c.batch);
    max_heads = std::max<int64_t>(max_heads, c.heads);
  }
  Buffers buf;
  cuda(cudaMalloc(&buf.q, max_rows * kPrefillQkDim * 2), "q");
  cuda(cudaMalloc(&buf.k, max_rows * kPrefillQkDim * 2), "k");
  // BF16 token-major, or FP8 transposed with its token positions rounded up to 16 per head.
  cuda(cudaMalloc(&buf.v, (max_rows + 16 * max_heads) * kPrefillVDim * 2), "v");
  cuda(cudaMalloc(&buf.out, max_rows * kPrefillVDim * 2), "out");
  cuda(cudaMalloc(&buf.lse, max_rows * 4), "lse");
  cuda(cudaMalloc(&buf.cu, (max_batch + 1) * 4), "cu_seqlens");
  cuda(cudaMalloc(&buf.flush, kFlushBytes), "flush");

  std::printf("\nprefill: ms = median of %d calls, L2 flushed before each; TFLOP/s by performance.md's prefill formula\n",
              iters);
  // The cuDNN column is a table measured on another day, not a same-run peer (prefill_peer.py is).
  std::printf("%-5s %3s %3s %6s %-6s | %8s %8s %6s | %-22s | %s\n", "dtype", "H", "B", "len", "mask", "ms", "TFLOP/s",
              "%mma", "cuDNN table ms, / ours", "SM clock, power, throttle (nvidia-smi)");
  int status = 0;
  DType filled = DType::kUInt8;
  for (const PrefillCase& c : cases) {
    const int64_t e = static_cast<int64_t>(dtype_size(c.dtype));
    if (c.dtype != filled) {  // one draw per dtype, so a case alone reads what it reads in the grid
      std::mt19937_64 rng(2026 + static_cast<int>(c.dtype));
      fill_normal(buf.q, max_rows * kPrefillQkDim * e, c.dtype, rng);
      fill_normal(buf.k, max_rows * kPrefillQkDim * e, c.dtype, rng);
      fill_normal(buf.v, (max_rows + 16 * max_heads) * kPrefillVDim * e, c.dtype, rng);
      filled = c.dtype;
    }
    std::vector<int32_t> cu(c.batch + 1);
    for (int b = 0; b <= c.batch; ++b) cu[b] = b * c.len;
    cuda(cudaMemcpy(buf.cu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice), "cu_seqlens");
    const int64_t tokens = int64_t{c.batch} * c.len;
    const TensorView q = make_view(buf.q, c.dtype, dev, {tokens, c.heads, kPrefillQkDim});
    const TensorView k = make_view(buf.k, c.dtype, dev, {tokens, c.heads, kPrefillQkDim});
    const TensorView v = make_view(buf.v, c.dtype, dev, prefill_value_shape(tokens, c.heads, c.v_layout));
    const TensorView out = make_view(buf.out, DType::kBFloat16, dev, {tokens, c.heads, kPrefillVDim});
    const TensorView lse = make_view(buf.lse, DType::kFloat32, dev, {tokens, c.heads});
    const TensorView cu_view = make_view(buf.cu, DType::kInt32, dev, {c.batch + 1});
    const bool fp8 = c.dtype == DType::kFloat8E4M3;
    std::printf("%-5s %3d %3d %6d %-6s | ", c.v_layout == PrefillValueLayout::kFp8Transposed ? "fp8t" : fp8 ? "fp8" : "bf16", c.heads, c.batch, c.len,
                c.causal ? "causal" : "full");
    std::fflush(stdout);
    if (rest_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(rest_ms));

    GpuStateSampler sampler;
    double ms = 0;
    try {
      ms = median_flushed_ms(
          [&] { mla_prefill(q, k, v, c.v_layout, cu_view, cu_view, out, lse, c.causal, 0.0721688f, 1.f); },
                             buf.flush, kFlushBytes, iters, 3, [&] { sampler.start(); });
    } catch (const Error& error) {
      std::printf("refused: %s\n", error.what());
      status = 1;
    }
    const std::string state = sampler.stop();
    if (ms == 0) continue;
    const double tflops = prefill_flops(c) / (ms * 1e-3) / 1e12;
    std::string peer = "-";
    if (const auto it = kCudnnBf16.find({c.heads, c.batch, c.len}); it != kCudnnBf16.end() && c.causal) {
      char text[48];
      std::snprintf(text, sizeof text, "%.3f ms, %.2fx", it->second, it->second / ms);
      peer = text;
    }
    std::printf("%8.3f %8.1f %5.1f%% | %-22s | %s\n", ms, tflops, 100.0 * tflops / (fp8 ? kFp8Tflops : kBf16Tflops),
                peer.c_str(), state.empty() ? "n/a" : state.c_str());
    std::fflush(stdout);
  }
  for (void* p : {buf.q, buf.k, buf.v, buf.out, buf.lse, buf.cu, buf.flush}) cudaFree(p);
  return status;
}

}  // namespace speedmla::bench
