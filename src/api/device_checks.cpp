// The check mode's switch and flags (speedmla/check.h); the validation itself is in
// src/kernels/check/, called by each operation's dispatch when device_checks_enabled().
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "api/check.h"
#include "kernels/check/value_checks.h"
#include "speedmla/check.h"

namespace speedmla {
namespace {

// -1 until the environment is read (on the first query), then 0 or 1.
std::atomic<int> checks_state{-1};

}  // namespace

void set_device_checks(bool enabled) { checks_state.store(enabled ? 1 : 0, std::memory_order_relaxed); }

bool device_checks_enabled() {
  int state = checks_state.load(std::memory_order_relaxed);
  if (state < 0) {
    const char* env = std::getenv("SPEEDMLA_CHECK");
    int expected = -1;
    checks_state.compare_exchange_strong(expected, env != nullptr && std::strcmp(env, "1") == 0 ? 1 : 0,
                                         std::memory_order_relaxed);
    state = checks_state.load(std::memory_order_relaxed);
  }
  return state == 1;
}

uint32_t take_device_check_flags(Device device, Stream stream) {
  if (device.kind != DeviceKind::kCUDA) return kernels::take_host_flags();
  const detail::ArgChecker check("take_device_check_flags");
  check.require(device.index >= 0, "device index must be >= 0, got ", device.index);
  const detail::DeviceGuard guard(device, check.function());
  uint32_t flags = 0;
  detail::check_cuda(kernels::take_device_flags(&flags, stream), check.function(), "reading the flag word");
  return flags;
}

std::string describe_device_check_flags(uint32_t flags) {
  static constexpr std::pair<uint32_t, const char*> kNames[] = {
      {kCheckDecodeSeqLen, "decode seq_len out of range"},
      {kCheckDecodePageId, "decode page id out of range"},
      {kCheckDecodeShortSeq, "decode seq_len below q_len"},
      {kCheckPrefillCuSeqlens, "prefill cu_seqlens invalid"},
      {kCheckCacheSlot, "cache slot past the cache"},
      {kCheckPoolIndex, "backend pool index out of range"}};
  std::string text;
  for (const auto& [bit, name] : kNames)
    if (flags & bit) text += (text.empty() ? "" : ", ") + std::string(name);
  return text.empty() ? "none" : text;
}

}  // namespace speedmla
