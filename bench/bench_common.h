// What the decode and prefill benchmarks share: CUDA error checks, the median, and a sample of the
// GPU's clocks and power taken while a case runs.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

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

// nvidia-smi's SM clock, power draw and active throttle reasons, queried over and over on a
// thread between start() and stop(): one query takes tens of milliseconds, so the first one that
// completes was taken while the case ran. "" when nvidia-smi is missing or answered nothing.
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
