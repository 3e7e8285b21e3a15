// speedmla-run: the library's main job on a DeepSeek-V3-shaped batch, end to end through the
// public API, on the GPU when there is one and on the CPU reference otherwise.
//
//   speedmla-run [--heads H] [--batch B] [--q-len Q] [--max-len S] [--page P] [--dtype fp8|bf16]
//                [--prefill-batch N] [--prefill-len L] [--cpu] [--seed N]
//
// Decode/verify: new KV rows are written into a paged cache with kv_cache_write (FP8 quantised
// on the way), queries quantised with quantize_fp8, then mla_decode runs over mixed sequence
// lengths (page tables shuffled across the pool, padded with the null page). Prefill: the
// un-absorbed K/V are packed with pack_prefill_kv (FP8: values in the kFp8Transposed layout, the
// fast path) and mla_prefill runs causally over ragged requests. Each result is checked against the CPU reference on a sample of requests, and a
// table reports shapes, time, TFLOP/s and GB/s by the formulas of ../shared/spec/performance.md.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "speedmla/speedmla.h"

namespace {

using namespace speedmla;

struct Options {
  int64_t heads = -1, batch = -1, q_len = 2, max_len = -1, page = 64, prefill_batch = 4, prefill_len = -1;
  DType dtype = DType::kFloat8E4M3;
  bool cpu = false;
  uint64_t seed = 2026;
};

[[noreturn]] void usage(const char* argv0, int status = 2) {
  std::fprintf(status == 0 ? stdout : stderr,
               "usage: %s [--heads H] [--batch B] [--q-len Q] [--max-len S] [--page P] [--dtype fp8|bf16]\n"
               "          [--prefill-batch N] [--prefill-len L] [--cpu] [--seed N]\n",
               argv0);
  std::exit(status);
}

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "speedmla-run: %s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

// A contiguous tensor in host memory, mirrored on the device when `device` is CUDA.
class Buffer {
 public:
  Buffer(DType dtype, std::vector<int64_t> shape, Device device) : dtype_(dtype), shape_(std::move(shape)), device_(device) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    host_.assign(static_cast<size_t>(n) * dtype_size(dtype), 0);
    if (device.kind == DeviceKind::kCUDA && !host_.empty()) cuda_check(cudaMalloc(&device_ptr_, host_.size()), "cudaMalloc");
  }
  ~Buffer() {
    if (device_ptr_) cudaFree(device_ptr_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  TensorView view() const { return make(device_ptr_ ? device_ptr_ : const_cast<uint8_t*>(host_.data()), device_); }
  TensorView host_view() const { return make(const_cast<uint8_t*>(host_.data()), Device{}); }
  template <typename T> T* host() { return reinterpret_cast<T*>(host_.data()); }
  void upload() {
    if (device_ptr_) cuda_check(cudaMemcpy(device_ptr_, host_.data(), host_.size(), cudaMemcpyHostToDevice), "upload");
  }
  void download() {
    if (device_ptr_) cuda_check(cudaMemcpy(host_.data(), device_ptr_, host_.size(), cudaMemcpyDeviceToHost), "download");
  }
  size_t bytes() const { return host_.size(); }

 private:
  TensorView make(void* data, Device device) const { return make_view(data, dtype_, device, shape_); }
  DType dtype_;
  std::vector<int64_t> shape_;
  Device device_;
  std::vector<uint8_t> host_;
  void* device_ptr_ = nullptr;
};

void fill_bf16(Buffer& b, std::mt19937_64& rng, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  auto* p = b.host<uint16_t>();
  for (size_t i = 0; i < b.bytes() / 2; ++i) p[i] = float_to_bf16(u(rng));
  b.upload();
}

// Rows [begin, begin + count) of dimension 0 of a contiguous view.
TensorView rows(TensorView v, int64_t begin, int64_t count) {
  v.data = static_cast<uint8_t*>(v.data) + begin * v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
  v.shape[0] = count;
  return v;
}

double value_at(const TensorView& v, int64_t i) {
  switch (v.dtype) {
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(v.data)[i]);
    case DType::kFloat32: return static_cast<const float*>(v.data)[i];
    default: return 0;
  }
}

struct Error2 {
  double rel_l2 = 0, max_abs = 0;
};
Error2 compare(const TensorView& got, const TensorView& ref) {
  double d2 = 0, r2 = 0, mx = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double a = value_at(got, i), b = value_at(ref, i);
    if (std::isinf(b) && a == b) continue;
    d2 += (a - b) * (a - b);
    r2 += b * b;
    mx = std::max(mx, std::abs(a - b));
  }
  return {std::sqrt(d2 / std::max(r2, 1e-300)), mx};
}

// The check column: `requests` requests of a GPU result against the CPU reference.
std::string check_text(int64_t requests, const TensorView& out, const TensorView& ref_out, const TensorView& lse,
                       const TensorView& ref_lse) {
  const Error2 e = compare(out, ref_out), el = compare(lse, ref_lse);
  char text[160];
  std::snprintf(text, sizeof text, "%lld req: out rel L2 %.2e, lse max |err| %.1e", static_cast<long long>(requests),
                e.rel_l2, el.max_abs);
  return text;
}

// Median time of `fn` in ms: CUDA events on the GPU, the wall clock on the CPU.
template <typename Fn>
double time_ms(bool gpu, int iterations, Fn&& fn) {
  std::vector<double> times;
  if (gpu) {  // warm-up: the first launch loads the module
    fn();
    cuda_check(cudaDeviceSynchronize(), "warm-up");
  }
  for (int i = 0; i < iterations; ++i) {
    if (gpu) {
      cudaEvent_t a, b;
      cudaEventCreate(&a);
      cudaEventCreate(&b);
      cudaEventRecord(a);
      fn();
      cudaEventRecord(b);
      cuda_check(cudaEventSynchronize(b), "timing");
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      times.push_back(ms);
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct Row {
  std::string op, where, shape;
  double ms, tflops, gbs;
  std::string check;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : (usage(argv[0]), nullptr); };
    if (!std::strcmp(argv[i], "--heads")) o.heads = std::atoll(next());
    else if (!std::strcmp(argv[i], "--batch")) o.batch = std::atoll(next());
    else if (!std::strcmp(argv[i], "--q-len")) o.q_len = std::atoll(next());
    else if (!std::strcmp(argv[i], "--max-len")) o.max_len = std::atoll(next());
    else if (!std::strcmp(argv[i], "--page")) o.page = std::atoll(next());
    else if (!std::strcmp(argv[i], "--prefill-batch")) o.prefill_batch = std::atoll(next());
    else if (!std::strcmp(argv[i], "--prefill-len")) o.prefill_len = std::atoll(next());
    else if (!std::strcmp(argv[i], "--seed")) o.seed = std::strtoull(next(), nullptr, 10);
    else if (!std::strcmp(argv[i], "--cpu")) o.cpu = true;
    else if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) usage(argv[0], 0);
    else if (!std::strcmp(argv[i], "--dtype")) {
      const std::string d = next();
      if (d != "fp8" && d != "bf16") usage(argv[0]);
      o.dtype = d == "fp8" ? DType::kFloat8E4M3 : DType::kBFloat16;
    } else usage(argv[0]);
  }
  int devices = 0;
  const bool gpu = !o.cpu && cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  // DeepSeek-V3 at TP=1 (128 heads) on a GPU; at TP=8 (16 heads) and a smaller batch on the CPU,
  // where the reference (FP64) must finish in seconds.
  if (o.heads < 0) o.heads = gpu ? 128 : 16;
  if (o.batch < 0) o.batch = gpu ? 64 : 4;
  if (o.max_len < 0) o.max_len = gpu ? 8192 : 1024;
  // Prefill lengths stay short enough on the GPU for the CPU reference to check two requests.
  if (o.prefill_len < 0) o.prefill_len = gpu ? 512 : 256;
  const Device device = gpu ? Device{DeviceKind::kCUDA, 0} : Device{};
  std::mt19937_64 rng(o.seed);
  if (gpu) {
    cudaDeviceProp prop;
    cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    std::printf("speedmla-run on %s (%d SMs); seed %llu\n", prop.name, prop.multiProcessorCount,
                static_cast<unsigned long long>(o.seed));
  } else {
    std::printf("speedmla-run on the CPU reference (no CUDA device%s); seed %llu\n", o.cpu ? " requested" : "",
                static_cast<unsigned long long>(o.seed));
  }
  std::vector<Row> table;

  // ---------------- decode / verify ----------------
  {
    const int64_t B = o.batch, Q = o.q_len, H = o.heads, page = o.page;
    std::uniform_real_distribution<double> log_len(std::log(double(Q)), std::log(double(o.max_len)));
    std::vector<int32_t> lens(B);
    for (auto& l : lens) l = static_cast<int32_t>(std::exp(log_len(rng)));
    int64_t total_tokens = 0, max_pages = 0;
    for (int32_t l : lens) {
      total_tokens += l;
      max_pages = std::max<int64_t>(max_pages, (l + page - 1) / page);
    }
    const int64_t pool_pages = 1 + std::accumulate(lens.begin(), lens.end(), int64_t{0},
                                                   [&](int64_t s, int32_t l) { return s + (l + page - 1) / page; });
    // The engine's side: a page table over a shuffled pool (page 0 = null page for padding)
    // and the slot of every token.
    std::vector<int32_t> pool(pool_pages - 1);
    std::iota(pool.begin(), pool.end(), 1);
    std::shuffle(pool.begin(), pool.end(), rng);
    // Rows padded with the null page to a multiple of 128 / page_size pages, as the seed does.
    const int64_t multiple = std::max<int64_t>(1, 128 / page);
    const int64_t table_cols = (max_pages + multiple - 1) / multiple * multiple;
    Buffer block_table(DType::kInt32, {B, table_cols}, device), seq_lens(DType::kInt32, {B}, device);
    Buffer slots(DType::kInt64, {total_tokens}, device);
    int64_t next_page = 0, t = 0;
    for (int64_t b = 0; b < B; ++b) {
      seq_lens.host<int32_t>()[b] = lens[b];
      for (int64_t c = 0; c < table_cols; ++c)
        block_table.host<int32_t>()[b * table_cols + c] = c * page < lens[b] ? pool[next_page++] : 0;
      for (int64_t k = 0; k < lens[b]; ++k, ++t)
        slots.host<int64_t>()[t] = int64_t{block_table.host<int32_t>()[b * table_cols + k / page]} * page + k % page;
    }
    block_table.upload();
    seq_lens.upload();
    slots.upload();

    Buffer cache(o.dtype, {pool_pages, page, kCacheRowDim}, device);
    Buffer latent(DType::kBFloat16, {total_tokens, kLatentDim}, device), rope(DType::kBFloat16, {total_tokens, kRopeDim}, device);
    fill_bf16(latent, rng, 1.f);
    fill_bf16(rope, rng, 1.f);
    kv_cache_write(cache.view(), slots.view(), latent.view(), rope.view(), 1.f);

    Buffer q_bf16(DType::kBFloat16, {B, Q, H, kCacheRowDim}, device), q(o.dtype, {B, Q, H, kCacheRowDim}, device);
    fill_bf16(q_bf16, rng, 1.f);
    if (o.dtype == DType::kFloat8E4M3) quantize_fp8(q_bf16.view(), q.view(), 1.f);
    const TensorView q_view = o.dtype == DType::kFloat8E4M3 ? q.view() : q_bf16.view();
    if (o.dtype == DType::kFloat8E4M3) q.download(); else q_bf16.download();
    cache.download();

    Buffer out(DType::kBFloat16, {B, Q, H, kLatentDim}, device), lse(DType::kFloat32, {B, Q, H}, device);
    const size_t ws_bytes = gpu ? mla_decode_workspace_size(B, H, Q, device_sm_count(0)) : 0;
    Buffer workspace(DType::kUInt8, {static_cast<int64_t>(std::max<size_t>(ws_bytes, 1))}, device);
    const float scale = 1.f / std::sqrt(192.f);  // DeepSeek-V3's softmax scale (q·k over 192 dims)
    auto run = [&] {
      mla_decode(q_view, cache.view(), block_table.view(), seq_lens.view(), out.view(), lse.view(),
                 gpu ? std::optional<TensorView>(workspace.view()) : std::nullopt, scale, 1.f);
    };
    const double ms = time_ms(gpu, gpu ? 20 : 1, run);
    out.download();
    lse.download();

    // The reference on the first requests (all of them on the CPU, where it is the result).
    const int64_t sample = gpu ? std::min<int64_t>(B, 2) : B;
    std::string check = "is the reference";
    if (gpu) {
      Buffer ref_out(DType::kBFloat16, {sample, Q, H, kLatentDim}, Device{});
      Buffer ref_lse(DType::kFloat32, {sample, Q, H}, Device{});
      const TensorView q_host = o.dtype == DType::kFloat8E4M3 ? q.host_view() : q_bf16.host_view();
      mla_decode(rows(q_host, 0, sample), cache.host_view(), rows(block_table.host_view(), 0, sample),
                 rows(seq_lens.host_view(), 0, sample), ref_out.host_view(), ref_lse.host_view(), std::nullopt, scale, 1.f);
      check = check_text(sample, rows(out.host_view(), 0, sample), ref_out.host_view(),
                         rows(lse.host_view(), 0, sample), ref_lse.host_view());
    }
    const double e = static_cast<double>(dtype_size(o.dtype));
    const double flops = 2.0 * Q * total_tokens * H * (kCacheRowDim + kLatentDim);
    const double bytes = total_tokens * kCacheRowDim * e + double(B) * Q * H * (kCacheRowDim * e + kLatentDim * 2);
    char shape[160];
    std::snprintf(shape, sizeof shape, "%s B=%lld q_len=%lld H=%lld page=%lld, seq %d..%d (sum %lld)",
                  dtype_name(o.dtype), static_cast<long long>(B), static_cast<long long>(Q), static_cast<long long>(H),
                  static_cast<long long>(page), *std::min_element(lens.begin(), lens.end()),
                  *std::max_element(lens.begin(), lens.end()), static_cast<long long>(total_tokens));
    table.push_back({"mla_decode", gpu ? "GPU" : "CPU ref", shape, ms, flops / ms / 1e9, bytes / ms / 1e6, check});
  }

  // ---------------- prefill (ragged, causal) ----------------
  {
    const int64_t B = o.prefill_batch, H = o.heads;
    std::uniform_int_distribution<int64_t> len(1, o.prefill_len);
    std::vector<int32_t> cu(B + 1, 0);
    double flops = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t l = len(rng);
      cu[b + 1] = static_cast<int32_t>(cu[b] + l);
      flops += 2.0 * H * (kPrefillQkDim + kPrefillVDim) * (double(l) * l - double(l) * (l - 1) / 2);
    }
    const int64_t T = cu[B];
    Buffer k_nope(DType::kBFloat16, {T, H, 128}, device), k_rope(DType::kBFloat16, {T, kRopeDim}, device);
    Buffer v(DType::kBFloat16, {T, H, kPrefillVDim}, device), q(DType::kBFloat16, {T, H, kPrefillQkDim}, device);
    fill_bf16(k_nope, rng, 1.f);
    fill_bf16(k_rope, rng, 1.f);
    fill_bf16(v, rng, 1.f);
    fill_bf16(q, rng, 1.f);
    const bool fp8 = o.dtype == DType::kFloat8E4M3;
    const PrefillValueLayout layout = fp8 ? PrefillValueLayout::kFp8Transposed : PrefillValueLayout::kTokenMajor;
    Buffer k8(o.dtype, {T, H, kPrefillQkDim}, device), q8(o.dtype, {T, H, kPrefillQkDim}, device);
    Buffer v8(o.dtype, prefill_value_shape(T, H, layout), device);
    pack_prefill_kv(k_nope.view(), k_rope.view(), v.view(), k8.view(), v8.view(), layout, 1.f, 1.f);
    if (fp8) quantize_fp8(q.view(), q8.view(), 1.f);
    Buffer& q_in = fp8 ? q8 : q;
    Buffer cu_q(DType::kInt32, {B + 1}, device);
    std::copy(cu.begin(), cu.end(), cu_q.host<int32_t>());
    cu_q.upload();
    Buffer out(DType::kBFloat16, {T, H, kPrefillVDim}, device), lse(DType::kFloat32, {T, H}, device);
    const float scale = 1.f / std::sqrt(192.f);
    const double ms = time_ms(gpu, gpu ? 20 : 1, [&] {
      mla_prefill(q_in.view(), k8.view(), v8.view(), layout, cu_q.view(), cu_q.view(), out.view(), lse.view(), true,
                  scale, 1.f);
    });

    // The reference on the first requests (all of them on the CPU, where it is the result).
    std::string check = "is the reference";
    if (gpu) {
      const int64_t sample = std::min<int64_t>(B, 2), rows_checked = cu[sample];
      for (Buffer* b : {&q_in, &k8, &v8, &out, &lse}) b->download();
      Buffer ref_out(DType::kBFloat16, {rows_checked, H, kPrefillVDim}, Device{});
      Buffer ref_lse(DType::kFloat32, {rows_checked, H}, Device{});
      const TensorView cu_sample = rows(cu_q.host_view(), 0, sample + 1);
      // Transposed values are [H, 128, positions]: the sample's tokens are the first positions.
      mla_prefill(rows(q_in.host_view(), 0, rows_checked), rows(k8.host_view(), 0, rows_checked),
                  fp8 ? v8.host_view() : rows(v8.host_view(), 0, rows_checked), layout, cu_sample, cu_sample,
                  ref_out.host_view(), ref_lse.host_view(), true, scale, 1.f);
      check = check_text(sample, rows(out.host_view(), 0, rows_checked), ref_out.host_view(),
                         rows(lse.host_view(), 0, rows_checked), ref_lse.host_view());
    }
    char shape[160];
    std::snprintf(shape, sizeof shape, "%s %lld requests, %lld tokens, H=%lld, causal%s", dtype_name(o.dtype),
                  static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(H),
                  fp8 ? ", v transposed" : "");
    const double e = static_cast<double>(dtype_size(o.dtype));
    const double bytes = T * H * ((kPrefillQkDim * 2 + kPrefillVDim) * e + kPrefillVDim * 2);
    table.push_back({"mla_prefill", gpu ? "GPU" : "CPU ref", shape, ms, flops / ms / 1e9, bytes / ms / 1e6, check});
  }

  std::printf("\n%-11s %-8s %-62s %10s %9s %9s  %s\n", "op", "on", "shape", "time ms", "TFLOP/s", "GB/s", "check");
  for (const Row& r : table)
    std::printf("%-11s %-8s %-62s %10.3f %9.3g %9.4g  %s\n", r.op.c_str(), r.where.c_str(), r.shape.c_str(), r.ms,
                r.tflops, r.gbs, r.check.c_str());
  return 0;
}
