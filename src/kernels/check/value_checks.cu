// The check mode's validation kernels: one thread per element, an atomicOr of the flags it
// raises into one word per device. Only launched when the check mode is on.
#include "kernels/check/value_checks.h"
#include "kernels/common/launch.cuh"

namespace speedmla::kernels {
namespace {

// One word per device: a __device__ variable exists once in every context (device) the module
// is loaded into.
__device__ uint32_t g_check_flags;

__device__ __forceinline__ void raise(uint32_t flags) {
  if (flags) atomicOr(&g_check_flags, flags);
}

__global__ void check_decode_values_kernel(DecodeValuesCheck p) {
  for (int64_t b = global_thread_index(); b < p.batch; b += global_thread_count()) raise(decode_request_flags(p, b));
}

__global__ void check_cu_seqlens_kernel(CuSeqlensCheck p) {
  for (int64_t i = global_thread_index(); i < p.entries; i += global_thread_count()) raise(cu_seqlens_entry_flags(p, i));
}

__global__ void check_slots_kernel(SlotsCheck p) {
  for (int64_t i = global_thread_index(); i < p.count; i += global_thread_count()) raise(slot_flags(p, i));
}

__global__ void check_pool_indices_kernel(PoolIndicesCheck p) {
  for (int64_t r = global_thread_index(); r < p.rows; r += global_thread_count()) raise(pool_index_flags(p, r));
}

}  // namespace

void run_check_decode_values(const DecodeValuesCheck& params, Stream stream) {
  launch_elementwise(check_decode_values_kernel, params.batch, params, stream);
}
void run_check_cu_seqlens(const CuSeqlensCheck& params, Stream stream) {
  launch_elementwise(check_cu_seqlens_kernel, params.entries, params, stream);
}
void run_check_slots(const SlotsCheck& params, Stream stream) {
  launch_elementwise(check_slots_kernel, params.count, params, stream);
}
void run_check_pool_indices(const PoolIndicesCheck& params, Stream stream) {
  launch_elementwise(check_pool_indices_kernel, params.rows, params, stream);
}

int take_device_flags(uint32_t* flags, Stream stream) {
  void* word = nullptr;
  cudaError_t status = cudaGetSymbolAddress(&word, g_check_flags);
  if (status == cudaSuccess) status = cudaMemcpyAsync(flags, word, sizeof(uint32_t), cudaMemcpyDeviceToHost, stream);
  if (status == cudaSuccess) status = cudaMemsetAsync(word, 0, sizeof(uint32_t), stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  return status;
}

}  // namespace speedmla::kernels
