// Where a consumer or producer stands in a ring of shared-memory stages guarded by mbarriers.
// Counting uses (blocks over the whole CTA's life, across tiles) give each stage's index and the
// parity of the phase that use completes; a stage's first use waits on its "free" barrier with
// the opposite parity, which an untouched mbarrier reports as completed.
#pragma once

#include <cstdint>

namespace speedmla::kernels::sm90 {

template <int kStages>
struct PipelineState {
  uint32_t count = 0;  // uses so far

  __device__ __forceinline__ int stage() const { return static_cast<int>(count % kStages); }
  // Parity of the phase that completes when this use's data has landed (a "full" barrier).
  __device__ __forceinline__ uint32_t full_parity() const { return (count / kStages) & 1u; }
  // Parity to wait for before overwriting the stage (a "free" barrier released by the readers
  // of the previous use); passes at once for the first kStages uses.
  __device__ __forceinline__ uint32_t free_parity() const { return full_parity() ^ 1u; }
  __device__ __forceinline__ void advance(uint32_t uses = 1) { count += uses; }
};

}  // namespace speedmla::kernels::sm90
