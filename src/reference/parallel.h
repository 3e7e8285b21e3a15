// A minimal parallel loop for the CPU reference: contiguous blocks of an index range on
// std::threads, serial when the work is too small to pay for starting threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace speedmla::reference {

// Below this much work (in the caller's unit, roughly multiply-adds) per thread, starting a
// thread costs more than it saves.
inline constexpr int64_t kMinWorkPerThread = int64_t{1} << 16;

// Calls body(i) for every i in [0, count), each exactly once, split over up to
// hardware_concurrency threads. `work_per_item` estimates the cost of one call. Calls for
// different i run concurrently, so they must write disjoint memory. body must not throw.
template <typename Body>
void parallel_for(int64_t count, int64_t work_per_item, const Body& body) {
  if (count <= 0) return;
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t by_work = std::max<int64_t>(1, count * std::max<int64_t>(work_per_item, 1) /
                                                   kMinWorkPerThread);
  const int64_t threads = std::min({hardware, count, by_work});
  if (threads == 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  const int64_t block = (count + threads - 1) / threads;
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads - 1));
  auto run_block = [&](int64_t begin) {
    const int64_t end = std::min(count, begin + block);
    for (int64_t i = begin; i < end; ++i) body(i);
  };
  for (int64_t begin = block; begin < count; begin += block) workers.emplace_back(run_block, begin);
  run_block(0);
  for (std::thread& worker : workers) worker.join();
}

}  // namespace speedmla::reference
