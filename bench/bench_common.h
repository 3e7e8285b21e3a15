// What the decode and prefill benchmarks share: CUDA error checks, the median, and a sample of the
// GPU's clocks and power taken while a case runs.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "speedmla/numeric.h"
#include "speedmla/tensor.h"

namespace speedmla::bench {

inline void cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

inline double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The median GPU time in ms of `call` over `iters` timed calls after `warmup` untimed ones, each
// call after a write of `flush_bytes` at `flush` (the L2 emptied of the inputs) and timed on its
// own with CUDA events on the default stream. `before_timed` runs once, before the first timed
// call. An exception from `call` leaves through here.
template <typename Call, typename BeforeTimed>
double median_flushed_ms(const Call& call, void* flush, size_t flush_bytes, int iters, int warmup,
                         const BeforeTimed& before_timed) {
  struct Events {
    cudaEvent_t start = nullptr, stop = nullptr;
    Events() {
      cuda(cudaEventCreate(&start), "event");
      cuda(cudaEventCreate(&stop), "event");
    }
    ~Events() {
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    }
  } events;
  std::vector<float> times;
  for (int i = 0; i < warmup + iters; ++i) {
    if (i == warmup) before_timed();
    cuda(cudaMemsetAsync(flush, i & 0xFF, flush_bytes), "flush");
    cuda(cudaEventRecord(events.start), "record");
    call();
    cuda(cudaEventRecord(events.stop), "record");
    cuda(cudaEventSynchronize(events.stop), "sync");
    float ms = 0;
    cuda(cudaEventElapsedTime(&ms, events.start, events.stop), "elapsed");
    if (i >= warmup) times.push_back(ms);
  }
  return median(times);
}

template <typename Call>
double median_flushed_ms(const Call& call, void* flush, size_t flush_bytes, int iters, int warmup) {
  return median_flushed_ms(call, flush, flush_bytes, iters, warmup, [] {});
}

// Fills `bytes` of device memory with values of `dtype` (FP8 e4m3 or BF16) drawn from `dist`: a
// host block of at most `block_bytes` drawn once, copied over and over.
template <typename Distribution>
void fill_device(void* dst, size_t bytes, size_t block_bytes, DType dtype, Distribution& dist, std::mt19937_64& rng) {
  const size_t block = std::min(bytes, block_bytes);
  std::vector<uint8_t> host(block);
  if (dtype == DType::kFloat8E4M3) {
    for (auto& b : host) b = float_to_fp8_e4m3(dist(rng));
  } else {
    auto* h = reinterpret_cast<uint16_t*>(host.data());
    for (size_t i = 0; i < block / 2; ++i) h[i] = float_to_bf16(dist(rng));
  }
  for (size_t off = 0; off < bytes; off += block)
    cuda(cudaMemcpy(static_cast<uint8_t*>(dst) + off, host.data(), std::min(block, bytes - off), cudaMemcpyHostToDevice),
         "fill");
}

// Normal values (std 1, drawn as real activations are) of `dtype` over `bytes` of device memory,
// from a block of just under 64 MB (its length is no multiple of a row, so rows do not repeat in
// step).
inline void fill_normal(void* dst, size_t bytes, DType dtype, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  fill_device(dst, bytes, (size_t{64} << 20) - 96, dtype, normal, rng);
}

// nvidia-smi's SM clock, power draw and active throttle reasons, queried over and over on a
// thread between start() and stop(): one query takes tens of milliseconds, so the first one that
// completes was taken while the case ran. "" when nvidia-smi is missing or answered nothing.
// A sample is the board's state at that instant, most likely between the timed kernels (flushes,
// host work): inside the decode kernels clock64 against %globaltimer read 1640-1790 MHz where
// these samples read 1980 (bench/RESULTS.md, twenty-seventh session).
class GpuStateSampler {
 public:
  void start() {
    stop_ = false;
    samples_.clear();
    worker_ = std::thread([this] {
      do {
        const std::string line = query();
        if (line.empty()) return;  // no nvidia-smi: stop asking
        samples_.push_back(line);
      } while (!stop_);
    });
  }
  std::string stop() {
    stop_ = true;
    if (worker_.joinable()) worker_.join();
    return samples_.empty() ? std::string() : samples_.front();
  }

 private:
  static std::string query() {
    FILE* pipe = popen(
        "nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader "
        "2>/dev/null",
        "r");
    if (!pipe) return "";
    char line[256] = {};
    const bool read = std::fgets(line, sizeof line, pipe) != nullptr;
    const int status = pclose(pipe);
    if (!read || status != 0) return "";
    std::string s(line);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s;
  }

  std::thread worker_;
  std::atomic<bool> stop_{false};
  std::vector<std::string> samples_;  // written by the worker only until it is joined
};

}  // namespace speedmla::bench
