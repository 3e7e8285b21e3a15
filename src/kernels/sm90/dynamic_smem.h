// The dynamic shared-memory opt-in of a kernel, per device. A block may use more than 48 KB of
// dynamic shared memory only after cudaFuncSetAttribute raised the kernel's limit, and that
// attribute belongs to the current device's context: a process that drives several GPUs must set
// it on each. Launchers call ensure_dynamic_smem() before their first launch of the operation, and
// launch nothing when it fails (a kernel launched without it would not run, while the operation's
// other kernels would: a wrong result with no error).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

namespace speedmla::kernels::sm90 {

inline constexpr int kMaxDevices = 64;

// Sets `kernel`'s dynamic shared-memory limit to `bytes` on the current device unless that was
// already done (successfully) in this process. Returns the CUDA error (cudaSuccess when set).
// A failure is not remembered: the next call tries again and reports again. Thread-safe.
template <auto Kernel>
cudaError_t ensure_dynamic_smem(int bytes) {
  static std::array<std::atomic<int>, kMaxDevices> set_bytes{};  // 0: not set on that device
  int device = 0;
  if (const cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (set_bytes[device].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  const cudaError_t status = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (status == cudaSuccess) set_bytes[device].store(bytes, std::memory_order_release);
  return status;
}

}  // namespace speedmla::kernels::sm90
