// speedmla-bench: times mla_decode over the grid of ../shared/spec/performance.md, or
// mla_prefill over the prefill cases of issue 12 (--prefill, prefill_bench.cpp).
//
//   speedmla-bench [--quick] [--dtype fp8|bf16] [--page N]... [--iters N] [--rest-ms N]
//                  [--run-tokens N] [--case fp8|bf16,PAGE,B,S_K,H,Q_LEN]   (one case only, e.g. for a profiler)
//   speedmla-bench --read-floor   (the memory system's rate for rows gathered in runs, read_floor.h)
//   --plans also times, per case, the planner alone (mla_decode_plan), the call on a reused plan
//   (mla_decode_with_plan) and on a reused batch-invariant plan (issue 13, items 4 and 5).
//   speedmla-bench --prefill [--dtype fp8|bf16] [--iters N] [--rest-ms N]
//   speedmla-bench --prefill-case fp8|fp8t|bf16,H,B,LEN,CAUSAL   (repeatable; implies --prefill; fp8t: FP8, v transposed)
//
// q and the cache hold normal values (std 1), drawn as real activations are and as the prefill
// bench and the FlashMLA harness (decode_peer.py) draw them; before 2026-12-02 (b12ca52) they
// were uniform in [-1, 1), so earlier RESULTS.md decode figures came from flatter data.
//
// --rest-ms N leaves the GPU idle N ms before each case, so that every case starts from
// about the same clocks and temperature: right after the heaviest cells of the grid, one
// compute-bound cell took 12 % longer on the H200 than alone a minute later. The default (0)
// times the cases back to back.
//
// Every case: fixed sequence lengths, pages drawn at random from one large pool (the cache is
// far larger than the 60 MB L2) by a generator seeded from the case itself, or with
// --run-tokens N, runs of N tokens (consecutive pages) drawn at random: a page-1 cache an engine
// filled a prompt at a time holds long runs, while pages at random are the worst case. Cache values
// by one seeded from the dtype, so that a case reads the same pages and values alone (--case)
// as within a grid; the L2 flushed before each timed call, median of --iters calls
// timed one by one with CUDA events around the whole mla_decode (planner, main kernel and
// combine). Prints ms, TFLOP/s and GB/s by the formulas of performance.md and the share of the
// H200 ceilings; BF16 page-64 cells also show FlashMLA's time from a table of performance.md,
// measured on another day: a hint only. Same-run ratios come from bench/decode_peer.py.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bench_common.h"
#include "prefill_bench.h"
#include "read_floor.h"
#include "speedmla/speedmla.h"

namespace {

using namespace speedmla;
using bench::cuda;

// Ceilings measured on the H200 (performance.md).
constexpr double kReadTBs = 4.58, kFp8Tflops = 1267, kBf16Tflops = 700;

// FlashMLA, BF16 KV, page 64, B = 128 (performance.md), ms by (s_k, H, q_len).
const std::map<std::tuple<int, int, int>, double> kFlashMla = {
    {{4096, 16, 1}, 0.167},   {{4096, 16, 2}, 0.168},   {{4096, 32, 1}, 0.168},   {{4096, 32, 2}, 0.172},
    {{4096, 64, 1}, 0.170},   {{4096, 64, 2}, 0.253},   {{4096, 128, 1}, 0.271},  {{4096, 128, 2}, 0.489},
    {{8192, 16, 1}, 0.314},   {{8192, 16, 2}, 0.321},   {{8192, 32, 1}, 0.318},   {{8192, 32, 2}, 0.322},
    {{8192, 64, 1}, 0.325},   {{8192, 64, 2}, 0.520},   {{8192, 128, 1}, 0.523},  {{8192, 128, 2}, 0.976},
    {{16384, 16, 1}, 0.607},  {{16384, 16, 2}, 0.623},  {{16384, 32, 1}, 0.626},  {{16384, 32, 2}, 0.644},
    {{16384, 64, 1}, 0.657},  {{16384, 64, 2}, 1.039},  {{16384, 128, 1}, 1.034}, {{16384, 128, 2}, 1.911},
    {{32768, 16, 1}, 1.177},  {{32768, 16, 2}, 1.220},  {{32768, 32, 1}, 1.202},  {{32768, 32, 2}, 1.264},
    {{32768, 64, 1}, 1.268},  {{32768, 64, 2}, 2.041},  {{32768, 128, 1}, 2.041}, {{32768, 128, 2}, 3.757},
};
// The seed's long-context shape (q_len 4, s_k 81920), FlashMLA ms by (B, H).
const std::map<std::tuple<int, int>, double> kFlashMlaLong = {
    {{4, 16}, 0.135}, {{4, 32}, 0.168}, {{16, 16}, 0.405}, {{16, 32}, 0.658}};

struct Case {
  DType dtype;
  int page_size, batch, seq_len, heads, q_len;
};

// FlashMLA's published time for this shape (BF16 KV, page 64 only), or 0.
double flashmla_ms(const Case& c) {
  if (c.dtype != DType::kBFloat16 || c.page_size != 64) return 0;
  if (c.seq_len == 81920) {
    const auto it = kFlashMlaLong.find({c.batch, c.heads});
    return it == kFlashMlaLong.end() || c.q_len != 4 ? 0 : it->second;
  }
  const auto it = kFlashMla.find({c.seq_len, c.heads, c.q_len});
  return it == kFlashMla.end() || c.batch != 128 ? 0 : it->second;
}

struct Buffers {
  void* cache = nullptr;
  size_t cache_bytes = 0;
  void* flush = nullptr;
  size_t flush_bytes = size_t{256} << 20;
  void *q = nullptr, *out = nullptr, *lse = nullptr, *workspace = nullptr, *table = nullptr, *lens = nullptr;
};

struct Result {
  double ms, tflops, gbs;
  // --plans: the planner alone, the call on a reused balanced plan, and on a reused
  // batch-invariant plan (pieces of kDefaultInvariantSplitTokens); 0 when not timed.
  double plan_ms = 0, with_plan_ms = 0, invariant_ms = 0;
};

// The generator of a case's page order: the same for the same case in any run.
std::mt19937_64 case_rng(const Case& c) {
  std::seed_seq seed{static_cast<int>(c.dtype), c.page_size, c.batch, c.seq_len, c.heads, c.q_len};
  return std::mt19937_64(seed);
}

// Pages of `pages_needed`, from a pool of `pool_pages` (page 0 unused), placed in runs of
// `run_pages` consecutive pages, the runs in random order.
std::vector<int32_t> place_pages(int64_t pages_needed, int64_t pool_pages, int64_t run_pages, std::mt19937_64& rng) {
  std::vector<int32_t> runs((pool_pages - 1) / run_pages);
  for (size_t i = 0; i < runs.size(); ++i) runs[i] = static_cast<int32_t>(1 + i * run_pages);
  std::shuffle(runs.begin(), runs.end(), rng);
  std::vector<int32_t> table(pages_needed);
  for (int64_t i = 0; i < pages_needed; ++i) table[i] = runs[i / run_pages] + static_cast<int32_t>(i % run_pages);
  return table;
}

Result run_case(const Case& c, Buffers& buf, int iters, int run_tokens, bool plans) {
  const int64_t e = static_cast<int64_t>(dtype_size(c.dtype));
  const int64_t pages_per_seq = (c.seq_len + c.page_size - 1) / c.page_size;
  const int64_t pool_pages = static_cast<int64_t>(buf.cache_bytes / (c.page_size * kCacheRowDim * e));
  const int64_t pages_needed = c.batch * pages_per_seq;
  const int64_t run_pages = std::max<int64_t>(1, run_tokens / c.page_size);
  if (pages_needed + run_pages + 1 > pool_pages) {
    std::fprintf(stderr, "cache pool too small\n");
    std::exit(1);
  }
  std::mt19937_64 rng = case_rng(c);
  const std::vector<int32_t> table = place_pages(pages_needed, pool_pages, run_pages, rng);
  std::vector<int32_t> lens(c.batch, c.seq_len);
  cuda(cudaMemcpy(buf.table, table.data(), table.size() * 4, cudaMemcpyHostToDevice), "table");
  cuda(cudaMemcpy(buf.lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice), "lens");

  int device = 0;
  cuda(cudaGetDevice(&device), "device");
  const Device dev{DeviceKind::kCUDA, device};
  const TensorView q = make_view(buf.q, c.dtype, dev, {c.batch, c.q_len, c.heads, kCacheRowDim});
  const TensorView cache = make_view(buf.cache, c.dtype, dev, {pool_pages, c.page_size, kCacheRowDim});
  const TensorView bt = make_view(buf.table, DType::kInt32, dev, {c.batch, pages_per_seq});
  const TensorView sl = make_view(buf.lens, DType::kInt32, dev, {c.batch});
  const TensorView out = make_view(buf.out, DType::kBFloat16, dev, {c.batch, c.q_len, c.heads, kLatentDim});
  const TensorView lse = make_view(buf.lse, DType::kFloat32, dev, {c.batch, c.q_len, c.heads});
  const size_t ws_bytes = mla_decode_workspace_size(c.batch, c.heads, c.q_len, device_sm_count(device));
  const TensorView ws = make_view(buf.workspace, DType::kUInt8, dev, {static_cast<int64_t>(ws_bytes)});

  constexpr float kScale = 0.0416667f;
  const double ms = bench::median_flushed_ms([&] { mla_decode(q, cache, bt, sl, out, lse, ws, kScale, 1.f); },
                                             buf.flush, buf.flush_bytes, iters, 3);
  const double S = static_cast<double>(c.batch) * c.seq_len;
  const double flops = 2.0 * c.q_len * S * c.heads * (kCacheRowDim + kLatentDim);
  const double bytes = S * kCacheRowDim * e + double(c.batch) * c.q_len * c.heads * (kCacheRowDim * e + kLatentDim * 2);
  Result r{ms, flops / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9};
  if (plans) {
    r.plan_ms = bench::median_flushed_ms([&] { mla_decode_plan(sl, bt, c.heads, c.q_len, c.dtype, c.page_size, ws); },
                                         buf.flush, buf.flush_bytes, iters, 3);
    const DecodePlan balanced = mla_decode_plan(sl, bt, c.heads, c.q_len, c.dtype, c.page_size, ws);
    r.with_plan_ms = bench::median_flushed_ms(
        [&] { mla_decode_with_plan(balanced, q, cache, bt, sl, out, lse, kScale); }, buf.flush, buf.flush_bytes,
        iters, 3);
    const size_t invariant_bytes =
        mla_decode_workspace_size(c.batch, c.heads, c.q_len, device_sm_count(device), pages_per_seq * c.page_size,
                                  kDefaultInvariantSplitTokens);
    const TensorView invariant_ws =
        make_view(buf.workspace, DType::kUInt8, dev, {static_cast<int64_t>(invariant_bytes)});
    const DecodePlan invariant = mla_decode_plan(sl, bt, c.heads, c.q_len, c.dtype, c.page_size, invariant_ws,
                                                 kDefaultInvariantSplitTokens);
    r.invariant_ms = bench::median_flushed_ms(
        [&] { mla_decode_with_plan(invariant, q, cache, bt, sl, out, lse, kScale); }, buf.flush, buf.flush_bytes,
        iters, 3);
  }
  return r;
}

// The read rate of B = 128 requests' 8K cache rows (FP8 and BF16 row sizes) placed in runs of
// 1 to 1024 rows at random in the pool, against runs of 64 (the page size the TMA path reads).
void print_read_floor(Buffers& buf, int iters) {
  constexpr int64_t kRows = int64_t{128} * 8192;
  std::printf("\nrows gathered from a %.1f GB pool in runs of consecutive rows, runs at random\n",
              buf.cache_bytes / 1e9);
  std::printf("%9s %10s | %8s %8s %10s\n", "row bytes", "run rows", "ms", "GB/s", "vs run 64");
  for (const int row_bytes : {kCacheRowDim, kCacheRowDim * 2}) {
    const int64_t pool_rows = static_cast<int64_t>(buf.cache_bytes / row_bytes);
    double ms64 = 0;
    for (const int run : {64, 1, 2, 4, 8, 16, 1024}) {
      std::mt19937_64 rng(run);
      const std::vector<int32_t> rows = place_pages(kRows, pool_rows, run, rng);
      const std::vector<int64_t> offsets(rows.begin(), rows.end());
      std::vector<int64_t> bytes(offsets.size());
      for (size_t i = 0; i < offsets.size(); ++i) bytes[i] = offsets[i] * row_bytes;
      const double ms = bench::time_row_reads(buf.cache, bytes, row_bytes, buf.flush, buf.flush_bytes, iters);
      if (run == 64) ms64 = ms;
      std::printf("%9d %10d | %8.3f %8.0f %9.2fx\n", row_bytes, run, ms, kRows * row_bytes / (ms * 1e-3) / 1e9,
                  ms / ms64);
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int iters = 30;
  int rest_ms = 0;
  int run_tokens = 0;  // 0: every page placed on its own
  bool read_floor = false;
  bool plans = false;  // also time the planner, a reused plan and a batch-invariant plan
  std::vector<DType> dtypes = {DType::kFloat8E4M3, DType::kBFloat16};
  std::vector<int> pages;
  std::vector<Case> only;
  bool prefill = false;
  std::vector<bench::PrefillCase> prefill_only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--prefill")) prefill = true;
    else if (!std::strcmp(argv[i], "--prefill-case") && i + 1 < argc) {
      bench::PrefillCase c{};
      if (!bench::parse_prefill_case(argv[++i], c)) {
        std::fprintf(stderr, "--prefill-case wants fp8|fp8t|bf16,H,B,LEN,CAUSAL (e.g. bf16,128,4,4096,1)\n");
        return 2;
      }
      prefill_only.push_back(c);
      prefill = true;
    }
    else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--rest-ms") && i + 1 < argc) rest_ms = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--run-tokens") && i + 1 < argc) run_tokens = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--read-floor")) read_floor = true;
    else if (!std::strcmp(argv[i], "--plans")) plans = true;
    else if (!std::strcmp(argv[i], "--page") && i + 1 < argc) pages.push_back(std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--case") && i + 1 < argc) {
      char type[8] = {};
      Case c{};
      if (std::sscanf(argv[++i], "%7[^,],%d,%d,%d,%d,%d", type, &c.page_size, &c.batch, &c.seq_len, &c.heads,
                      &c.q_len) != 6) {
        std::fprintf(stderr, "--case wants fp8|bf16,PAGE,B,S_K,H,Q_LEN\n");
        return 2;
      }
      c.dtype = std::string(type) == "fp8" ? DType::kFloat8E4M3 : DType::kBFloat16;
      only.push_back(c);
    }
    else if (!std::strcmp(argv[i], "--dtype") && i + 1 < argc) {
      const std::string d = argv[++i];
      dtypes = {d == "fp8" ? DType::kFloat8E4M3 : DType::kBFloat16};
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--dtype fp8|bf16] [--page N]... [--iters N] [--rest-ms N] [--run-tokens N] [--plans]\n"
                   "          [--case ...]\n"
                   "       %s --read-floor\n"
                   "       %s --prefill [--dtype fp8|bf16] [--iters N] [--rest-ms N] [--prefill-case ...]\n",
                   argv[0], argv[0], argv[0]);
      return 2;
    }
  }
  if (pages.empty()) pages = {64, 32};
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("speedmla-bench: no CUDA device; nothing to time.\n");
    return 0;
  }
  cudaDeviceProp prop;
  cuda(cudaGetDeviceProperties(&prop, 0), "props");
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  if (prefill)
    return bench::run_prefill_cases(prefill_only.empty() ? bench::prefill_grid(dtypes) : prefill_only, iters, rest_ms);

  std::vector<Case> cases;
  const std::vector<int> lens = quick ? std::vector<int>{8192} : std::vector<int>{4096, 8192, 16384, 32768};
  for (DType dtype : dtypes)
    for (int page : pages) {
      for (int s : lens)
        for (int h : {16, 32, 64, 128})
          for (int ql : {1, 2}) cases.push_back({dtype, page, 128, s, h, ql});
      for (int b : {4, 16})
        for (int h : {16, 32}) cases.push_back({dtype, page, b, 81920, h, 4});
    }
  if (!only.empty()) cases = only;

  Buffers buf;
  buf.cache_bytes = size_t(128) * 32768 * kCacheRowDim * 2 + (size_t{64} << 20);
  cuda(cudaMalloc(&buf.cache, buf.cache_bytes), "cache");
  cuda(cudaMalloc(&buf.flush, buf.flush_bytes), "flush");
  cuda(cudaMalloc(&buf.q, size_t(128) * 4 * 128 * kCacheRowDim * 2), "q");
  cuda(cudaMalloc(&buf.out, size_t(128) * 4 * 128 * kLatentDim * 2), "out");
  cuda(cudaMalloc(&buf.lse, size_t(128) * 4 * 128 * 4), "lse");
  cuda(cudaMalloc(&buf.table, size_t(128) * 32768 * 4), "table");
  cuda(cudaMalloc(&buf.lens, 1024 * 4), "lens");
  size_t ws_max = 0;
  for (const Case& c : cases) {
    const int64_t max_kv_tokens = (c.seq_len + c.page_size - 1) / c.page_size * c.page_size;
    ws_max = std::max(ws_max, plans ? mla_decode_workspace_size(c.batch, c.heads, c.q_len, prop.multiProcessorCount,
                                                                max_kv_tokens, kDefaultInvariantSplitTokens)
                                    : mla_decode_workspace_size(c.batch, c.heads, c.q_len, prop.multiProcessorCount));
  }
  cuda(cudaMalloc(&buf.workspace, ws_max), "workspace");

  // Copy bandwidth in this run, as a check on the card's state against performance.md.
  {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    const size_t half = size_t{2} << 30;
    cudaMemcpy(static_cast<uint8_t*>(buf.cache) + half, buf.cache, half, cudaMemcpyDeviceToDevice);
    cudaEventRecord(a);
    for (int i = 0; i < 5; ++i)
      cudaMemcpyAsync(static_cast<uint8_t*>(buf.cache) + half, buf.cache, half, cudaMemcpyDeviceToDevice);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    std::printf("device-to-device copy: %.2f TB/s (read + write)\n", 5 * 2.0 * half / (ms * 1e-3) / 1e12);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }

  if (read_floor) {
    print_read_floor(buf, iters);
    return 0;
  }
  if (run_tokens > 0) std::printf("pages placed in runs of %d tokens\n", run_tokens);

  DType filled = DType::kUInt8;
  std::printf("\n%-5s %4s %4s %6s %3s %2s | %8s %8s %8s | %6s %6s | %s\n", "dtype", "page", "B", "s_k", "H", "q",
              "ms", "TFLOP/s", "GB/s", "%read", "%mma", "FlashMLA p64 table, not this run (ms, ratio)");
  for (const Case& c : cases) {
    if (c.dtype != filled) {
      std::mt19937_64 rng(2026 + static_cast<int>(c.dtype));
      bench::fill_normal(buf.cache, buf.cache_bytes, c.dtype, rng);
      bench::fill_normal(buf.q, size_t(128) * 4 * 128 * kCacheRowDim * 2, c.dtype, rng);
      filled = c.dtype;
    }
    if (rest_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(rest_ms));
    const Result r = run_case(c, buf, iters, run_tokens, plans);
    const bool fp8 = c.dtype == DType::kFloat8E4M3;
    std::string peer_text;
    if (const double peer = flashmla_ms(c); peer > 0) {
      char text[64];
      std::snprintf(text, sizeof text, "%.3f  %.2fx", peer, peer / r.ms);
      peer_text = text;
    }
    std::printf("%-5s %4d %4d %6d %3d %2d | %8.3f %8.1f %8.0f | %5.1f%% %5.1f%% | %s\n", fp8 ? "fp8" : "bf16",
                c.page_size, c.batch, c.seq_len, c.heads, c.q_len, r.ms, r.tflops, r.gbs,
                100.0 * r.gbs / (kReadTBs * 1000), 100.0 * r.tflops / (fp8 ? kFp8Tflops : kBf16Tflops), peer_text.c_str());
    if (plans)
      std::printf("      plans: planner alone %.4f ms (%.1f%% of the call); reused plan %.3f ms (%.1f%% less); "
                  "batch-invariant plan (%lld-token pieces) %.3f ms (%.2fx the reused balanced plan)\n",
                  r.plan_ms, 100.0 * r.plan_ms / r.ms, r.with_plan_ms, 100.0 * (r.ms - r.with_plan_ms) / r.ms,
                  static_cast<long long>(kDefaultInvariantSplitTokens), r.invariant_ms, r.invariant_ms / r.with_plan_ms);
    std::fflush(stdout);
  }
  return 0;
}
