// mla_decode in two halves, for callers inside the library that validate once and then run
// (MlaBackend::forward_decode builds some of mla_decode's arguments itself and must not check
// the engine's tensors twice). The public mla_decode is validate_decode + run_decode_validated.
#pragma once

#include <cstdint>
#include <optional>

#include "api/check.h"
#include "speedmla/decode.h"
#include "speedmla/tensor.h"

namespace speedmla::detail {

struct DecodeShape {
  int64_t batch, q_len, heads, num_pages, page_size, max_pages;
  int num_sms;  // of q's device when the GPU path runs (CUDA tensors, batch >= 1), else 0
};

// Every check mla_decode makes, messages named by `check`'s function: the contract (decode.h)
// on any device, then for CUDA tensors with batch >= 1 what the SM90 kernels need (page size,
// alignment, index bounds, compute capability 9.0) and the workspace. Launches nothing.
DecodeShape validate_decode(const ArgChecker& check, const TensorView& q, const TensorView& kv_cache,
                            const TensorView& block_table, const TensorView& seq_lens, const TensorView& out,
                            const std::optional<TensorView>& lse, const std::optional<TensorView>& workspace,
                            float softmax_scale, float output_scale,
                            const std::optional<DecodeContextParallel>& context_parallel = std::nullopt);

// That `plan` (from mla_decode_plan) was made for a call validate_decode accepted with `shape`:
// the same batch, heads, q_len, dtype, block-table width, page size, device and seq_lens tensor.
// Error names what differs.
void check_plan_matches(const ArgChecker& check, const DecodePlan& plan, const DecodeShape& shape,
                        const TensorView& q, const TensorView& seq_lens);

// mla_decode's work on arguments validate_decode accepted, with the shape it returned: the CPU
// reference, or the SM90 kernels on `stream`. With `plan` (checked by check_plan_matches, its
// workspace passed as `workspace`) the planner is not launched: the main kernel and the combine
// follow the plan already in the workspace. Checks no argument; `check` names the function in
// the launch errors.
void run_decode_validated(const ArgChecker& check, const DecodeShape& shape, const TensorView& q,
                          const TensorView& kv_cache, const TensorView& block_table, const TensorView& seq_lens,
                          const TensorView& out, const std::optional<TensorView>& lse,
                          const std::optional<TensorView>& workspace, float softmax_scale, float output_scale,
                          Stream stream, const std::optional<DecodeContextParallel>& context_parallel = std::nullopt,
                          const DecodePlan* plan = nullptr);

}  // namespace speedmla::detail
