// mla_decode: validation at the boundary, then the CPU reference or the SM90 kernels. The two
// halves (validate_decode, run_decode_validated: api/decode_internal.h) are also the library's own
// entry points for callers that validate once (MlaBackend::forward_decode).
#include "speedmla/decode.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>

#include "api/cache_layout.h"
#include "api/check.h"
#include "api/decode_internal.h"
#include "kernels/check/value_checks.h"
#include "kernels/decode/sm90/launch.h"
#include "kernels/decode/sm90/workspace.h"
#include "speedmla/check.h"
#include "speedmla/reference.h"

namespace speedmla {
namespace {

namespace dk = kernels::decode_sm90;
constexpr int kMaxQLen = kMaxDecodeQLen;  // q_len * H rows per request stay far inside int range

bool is_power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

using detail::DecodeShape;

// The contract's checks (decode.h), on any device.
DecodeShape validate_contract(const detail::ArgChecker& check, const TensorView& q, const TensorView& kv_cache,
                              const TensorView& block_table, const TensorView& seq_lens, const TensorView& out,
                              const std::optional<TensorView>& lse, float softmax_scale, float output_scale) {
  check.defined(q, "q", 4);
  check.dtype(q, "q", {DType::kFloat8E4M3, DType::kBFloat16});
  check.dim(q, "q", 3, kCacheRowDim);
  check.last_dim_contiguous(q, "q");
  DecodeShape shape{q.shape[0], q.shape[1], q.shape[2], 0, 0, 0, 0};
  check.require(shape.heads >= 1 && shape.heads <= kMaxDecodeHeads, "q.shape[2] (heads) must be in [1, ",
                kMaxDecodeHeads, "], got ", shape.heads);
  check.require(shape.q_len >= 1 && shape.q_len <= kMaxQLen, "q.shape[1] (q_len) must be in [1, ", kMaxQLen,
                "], got ", shape.q_len);

  const detail::CacheLayout layout = detail::check_cache_layout(check, kv_cache);
  shape.num_pages = layout.num_pages;
  shape.page_size = layout.page_size;
  check.require(kv_cache.dtype == q.dtype, "kv_cache must have the dtype of q (", dtype_name(q.dtype), "), got ",
                dtype_name(kv_cache.dtype));
  check.require(shape.num_pages >= 1, "kv_cache.shape[0] (num_pages) must be >= 1 (page 0 is the null page), got ",
                shape.num_pages);

  check.defined(block_table, "block_table", 2);
  check.dtype(block_table, "block_table", {DType::kInt32});
  check.dim(block_table, "block_table", 0, shape.batch);
  check.require(block_table.shape[1] <= 1 || block_table.strides[1] == 1,
                "block_table must be contiguous in its last dimension, got stride ", block_table.strides[1]);
  shape.max_pages = block_table.shape[1];

  check.defined(seq_lens, "seq_lens", 1);
  check.dtype(seq_lens, "seq_lens", {DType::kInt32});
  check.dim(seq_lens, "seq_lens", 0, shape.batch);
  check.contiguous(seq_lens, "seq_lens");

  check.defined(out, "out", 4);
  check.dtype(out, "out", {DType::kBFloat16});
  check.dim(out, "out", 0, shape.batch);
  check.dim(out, "out", 1, shape.q_len);
  check.dim(out, "out", 2, shape.heads);
  check.dim(out, "out", 3, kLatentDim);
  check.last_dim_contiguous(out, "out");
  if (lse) {
    check.defined(*lse, "lse", 3);
    check.dtype(*lse, "lse", {DType::kFloat32});
    check.dim(*lse, "lse", 0, shape.batch);
    check.dim(*lse, "lse", 1, shape.q_len);
    check.dim(*lse, "lse", 2, shape.heads);
  }
  for (const TensorView* t : {&kv_cache, &block_table, &seq_lens, &out})
    check.same_device(*t, t == &kv_cache ? "kv_cache" : t == &block_table ? "block_table"
                                                     : t == &seq_lens   ? "seq_lens"
                                                                        : "out",
                      q.device);
  if (lse) check.same_device(*lse, "lse", q.device);
  // Written tensors: no element twice, and no byte shared with anything else of the call.
  check.non_overlapping(out, "out");
  if (lse) check.non_overlapping(*lse, "lse");
  for (const auto& [input, name] : {std::pair{&q, "q"}, std::pair{&kv_cache, "kv_cache"},
                                    std::pair{&block_table, "block_table"}, std::pair{&seq_lens, "seq_lens"}}) {
    check.disjoint(out, "out", *input, name);
    if (lse) check.disjoint(*lse, "lse", *input, name);
  }
  if (lse) check.disjoint(*lse, "lse", out, "out");
  check.require(std::isfinite(softmax_scale) && softmax_scale > 0.f,
                "softmax_scale must be finite and > 0, got ", softmax_scale);
  check.require(std::isfinite(output_scale), "output_scale must be finite, got ", output_scale);
  return shape;
}

// The context-parallel argument (decode.h), on any device: causal_seqs is read like seq_lens.
void validate_context_parallel(const detail::ArgChecker& check, const DecodeContextParallel& cp,
                               const DecodeShape& shape, Device device, const TensorView& out,
                               const std::optional<TensorView>& lse) {
  const TensorView& causal = cp.causal_seqs;
  check.defined(causal, "context_parallel.causal_seqs", 1);
  check.dtype(causal, "context_parallel.causal_seqs", {DType::kInt32});
  check.dim(causal, "context_parallel.causal_seqs", 0, shape.batch);
  check.contiguous(causal, "context_parallel.causal_seqs");
  check.same_device(causal, "context_parallel.causal_seqs", device);
  check.disjoint(out, "out", causal, "context_parallel.causal_seqs");
  if (lse) check.disjoint(*lse, "lse", causal, "context_parallel.causal_seqs");
  check.require(cp.world >= 1 && cp.world <= kMaxDecodeContextParallelWorld, "context_parallel.world must be in [1, ",
                kMaxDecodeContextParallelWorld, "], got ", cp.world);
  check.require(cp.rank >= 0 && cp.rank < cp.world, "context_parallel.rank must be in [0, world = ", cp.world,
                "), got ", cp.rank);
}

// The batch-invariant piece size in 64-token blocks (0: the balanced policy).
int64_t split_blocks_of(const detail::ArgChecker& check, int64_t invariant_split_tokens) {
  check.require(invariant_split_tokens >= 0 && invariant_split_tokens % dk::kBlockTokens == 0 &&
                    invariant_split_tokens < (int64_t{1} << 31),
                "invariant_split_tokens must be 0 (the balanced plan) or a positive multiple of ", dk::kBlockTokens,
                " below 2^31, got ", invariant_split_tokens);
  return invariant_split_tokens / dk::kBlockTokens;
}

// 64-token blocks the planner counts for a request that may hold `tokens` (at least one), rounded
// up to whole pieces of the batch-invariant policy.
int64_t planned_blocks(int64_t tokens, int64_t split_blocks) {
  const int64_t blocks = std::max<int64_t>(1, (tokens + dk::kBlockTokens - 1) / dk::kBlockTokens);
  return split_blocks > 0 ? (blocks + split_blocks - 1) / split_blocks * split_blocks : blocks;
}

void check_heads_and_q_len(const detail::ArgChecker& check, int64_t num_heads, int64_t q_len) {
  check.require(num_heads >= 1 && num_heads <= kMaxDecodeHeads, "num_heads must be in [1, ", kMaxDecodeHeads,
                "], got ", num_heads);
  check.require(q_len >= 1 && q_len <= kMaxQLen, "q_len must be in [1, ", kMaxQLen, "], got ", q_len);
}

void check_workspace_size_args(const detail::ArgChecker& check, int64_t batch, int64_t num_heads, int64_t q_len,
                               int num_sms) {
  check.require(batch >= 1, "batch must be >= 1, got ", batch);
  check_heads_and_q_len(check, num_heads, q_len);
  check.require(num_sms >= 1, "num_sms must be >= 1, got ", num_sms);
}

}  // namespace

bool decode_page_size_supported(int64_t page_size) {
  return is_power_of_two(page_size) && page_size <= 128;
}

size_t mla_decode_workspace_size(int64_t batch, int64_t num_heads, int64_t q_len, int num_sms) {
  detail::ArgChecker check("mla_decode_workspace_size");
  check_workspace_size_args(check, batch, num_heads, q_len, num_sms);
  return dk::workspace_layout(batch, num_heads, q_len, num_sms).total_bytes;
}

size_t mla_decode_workspace_size(int64_t batch, int64_t num_heads, int64_t q_len, int num_sms,
                                 int64_t max_kv_tokens, int64_t invariant_split_tokens) {
  detail::ArgChecker check("mla_decode_workspace_size");
  check_workspace_size_args(check, batch, num_heads, q_len, num_sms);
  check.require(max_kv_tokens >= 1 && max_kv_tokens < (int64_t{1} << 31), "max_kv_tokens must be in [1, 2^31), got ",
                max_kv_tokens);
  const int64_t split_blocks = split_blocks_of(check, invariant_split_tokens);
  const int64_t blocks = planned_blocks(max_kv_tokens, split_blocks);
  check.require(batch <= (kMaxDecodeBlocks - 1) / blocks, "batch times the 64-token blocks of max_kv_tokens (",
                blocks, " after rounding up to whole pieces) must be < 2^30, got batch ", batch);
  return dk::workspace_layout(batch, num_heads, q_len, num_sms, split_blocks, blocks).total_bytes;
}

int device_sm_count(int device) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  if (device < 0 || device >= kMaxDevices) detail::fail("device_sm_count: device must be in [0, 64), got ", device);
  int count = cache[device].load(std::memory_order_relaxed);
  if (count == 0) {
    detail::check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "device_sm_count",
                       "cudaDeviceGetAttribute(MultiProcessorCount)");
    cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

namespace detail {
namespace {

// The workspace of a GPU call (already checked to be on the call's device): present,
// contiguous, 256-byte aligned and at least `needed` bytes, which mla_decode_workspace_size
// returns for `size_call`.
const TensorView& require_workspace(const ArgChecker& check, const std::optional<TensorView>& workspace,
                                    size_t needed, CallArguments size_call) {
  check.require(workspace.has_value(), "workspace is required for CUDA tensors (", needed,
                " bytes: mla_decode_workspace_size)");
  const TensorView& ws = *workspace;
  check.contiguous(ws, "workspace");
  check.require(reinterpret_cast<uintptr_t>(ws.data) % 256 == 0, "workspace must be 256-byte aligned");
  const size_t ws_bytes = static_cast<size_t>(ws.numel()) * dtype_size(ws.dtype);
  check.require(ws_bytes >= needed, "workspace must hold at least ", needed, " bytes (mla_decode_workspace_size(",
                size_call, ")), got ", ws_bytes);
  return ws;
}

}  // namespace

DecodeShape validate_decode(const ArgChecker& check, const TensorView& q, const TensorView& kv_cache,
                            const TensorView& block_table, const TensorView& seq_lens, const TensorView& out,
                            const std::optional<TensorView>& lse, const std::optional<TensorView>& workspace,
                            float softmax_scale, float output_scale,
                            const std::optional<DecodeContextParallel>& context_parallel) {
  DecodeShape shape = validate_contract(check, q, kv_cache, block_table, seq_lens, out, lse, softmax_scale,
                                        output_scale);
  if (context_parallel) validate_context_parallel(check, *context_parallel, shape, q.device, out, lse);
  // A workspace the CPU does not use is still checked: a device mix-up or a corrupt view is a
  // bug of the caller (and a negative extent would pass the GPU's size check as a huge size_t).
  if (workspace) {
    check.defined(*workspace, "workspace", workspace->ndim);
    check.same_device(*workspace, "workspace", q.device);
  }
  if (!q.is_cuda() || shape.batch == 0) return shape;  // the CPU reference, or nothing to launch

  // What the SM90 kernel needs beyond the contract's checks: the arguments first (no CUDA call),
  // then the device.
  check.require(decode_page_size_supported(shape.page_size),
                "kv_cache.shape[1] (page_size) must be a power of two in [1, 128] on the GPU, got ", shape.page_size);
  check.aligned(q, "q", 16);
  check.aligned(kv_cache, "kv_cache", 16);
  check.aligned(out, "out", 16);
  check.require(shape.max_pages * shape.page_size < (int64_t{1} << 31),
                "block_table.shape[1] * page_size must be < 2^31 tokens, got ", shape.max_pages * shape.page_size);
  // The batch's only bound: the planner counts the batch's 64-token blocks (at least one per
  // request) in int, and its part-size arithmetic reaches about 2.2 times that count. No grid
  // grows with the batch (the combine has min(batch, parts - 1) columns) and every index that
  // multiplies a stride by a request is 64-bit.
  const int64_t blocks_per_request =
      std::max<int64_t>(1, (shape.max_pages * shape.page_size + dk::kBlockTokens - 1) / dk::kBlockTokens);
  static_assert(dk::kBlockTokens == 64, "speedmla/decode.h documents kMaxDecodeBlocks in blocks of 64 tokens");
  check.require(shape.batch <= (kMaxDecodeBlocks - 1) / blocks_per_request,
                "q.shape[0] (batch) times the blocks of 64 tokens a block_table row can hold (",
                blocks_per_request, ") must be < 2^30 on the GPU, got batch ", shape.batch);
  check.require(shape.num_pages < (int64_t{1} << 31), "kv_cache.shape[0] (num_pages) must be < 2^31, got ",
                shape.num_pages);
  require_sm90(check, q.device);

  shape.num_sms = device_sm_count(q.device.index);
  const dk::WorkspaceLayout layout = dk::workspace_layout(shape.batch, shape.heads, shape.q_len, shape.num_sms);
  const TensorView& ws = require_workspace(check, workspace, layout.total_bytes,
                                           {{shape.batch, shape.heads, shape.q_len, shape.num_sms}});
  for (const auto& [other, name] :
       {std::pair{&q, "q"}, std::pair{&kv_cache, "kv_cache"}, std::pair{&block_table, "block_table"},
        std::pair{&seq_lens, "seq_lens"}, std::pair{&out, "out"}})
    check.disjoint(ws, "workspace", *other, name);
  if (lse) check.disjoint(ws, "workspace", *lse, "lse");
  if (context_parallel) check.disjoint(ws, "workspace", context_parallel->causal_seqs, "context_parallel.causal_seqs");

  return shape;
}

void run_decode_validated(const ArgChecker& check, const DecodeShape& shape, const TensorView& q,
                          const TensorView& kv_cache, const TensorView& block_table, const TensorView& seq_lens,
                          const TensorView& out, const std::optional<TensorView>& lse,
                          const std::optional<TensorView>& workspace, float softmax_scale, float output_scale,
                          Stream stream, const std::optional<DecodeContextParallel>& context_parallel,
                          const DecodePlan* plan) {
  // The check mode's view of the device-side values (speedmla/check.h).
  const kernels::DecodeValuesCheck values{seq_lens.ptr<const int32_t>(), block_table.ptr<const int32_t>(),
                                          block_table.strides[0], shape.batch, shape.max_pages, shape.page_size,
                                          shape.num_pages, shape.q_len};
  if (!q.is_cuda()) {
    if (device_checks_enabled()) kernels::check_decode_values_on_host(values);
    reference::mla_decode(q, kv_cache, block_table, seq_lens, out, lse, softmax_scale, output_scale, context_parallel);
    return;
  }
  if (shape.batch == 0) return;

  DeviceGuard guard(q.device, check.function());
  // A plan's layout is the one mla_decode_plan carved (its partial results may need more slots).
  const int64_t split_blocks = plan != nullptr ? plan->invariant_split_tokens / dk::kBlockTokens : 0;
  const dk::WorkspaceLayout layout =
      dk::workspace_layout(shape.batch, shape.heads, shape.q_len, shape.num_sms, split_blocks,
                           planned_blocks(shape.max_pages * shape.page_size, split_blocks));
  dk::DecodeLaunch launch{};
  launch.fp8 = q.dtype == DType::kFloat8E4M3;
  launch.batch = static_cast<int>(shape.batch);
  launch.q_len = static_cast<int>(shape.q_len);
  launch.num_heads = static_cast<int>(shape.heads);
  launch.page_size = static_cast<int>(shape.page_size);
  launch.max_pages = static_cast<int>(shape.max_pages);
  launch.num_pages = shape.num_pages;
  launch.q = q.data;
  launch.q_stride_batch = q.strides[0];
  launch.q_stride_token = q.strides[1];
  launch.q_stride_head = q.strides[2];
  launch.kv_cache = kv_cache.data;
  launch.kv_page_stride = kv_cache.strides[0];
  launch.block_table = block_table.ptr<int32_t>();
  launch.block_table_stride = block_table.strides[0];
  launch.seq_lens = seq_lens.ptr<int32_t>();
  launch.causal_seqs = context_parallel ? context_parallel->causal_seqs.ptr<int32_t>() : nullptr;
  launch.cp_world = context_parallel ? context_parallel->world : 1;
  launch.cp_rank = context_parallel ? context_parallel->rank : 0;
  launch.out = out.ptr<uint16_t>();
  launch.out_stride_batch = out.strides[0];
  launch.out_stride_token = out.strides[1];
  launch.out_stride_head = out.strides[2];
  if (lse) {
    launch.lse = lse->ptr<float>();
    launch.lse_stride_batch = lse->strides[0];
    launch.lse_stride_token = lse->strides[1];
    launch.lse_stride_head = lse->strides[2];
  }
  launch.workspace = workspace->data;
  launch.layout = layout;
  launch.softmax_scale = softmax_scale;
  launch.output_scale = output_scale;
  launch.split_units = static_cast<int>(split_blocks);
  if (device_checks_enabled()) {
    kernels::run_check_decode_values(values, stream);
    check_cuda(cudaGetLastError(), check.function(), "the check mode's validation kernel launch");
  }
  const dk::DecodeLaunchStatus status = dk::run_decode(launch, reinterpret_cast<cudaStream_t>(stream),
                                                       plan != nullptr ? dk::DecodeSteps::kWithPlan : dk::DecodeSteps::kAll);
  check.require(status.tensor_map == 0, "could not describe kv_cache to the TMA unit (cuTensorMapEncodeTiled error ",
                status.tensor_map, ")");
  check_cuda(status.cuda, check.function(), "the shared-memory opt-in or a kernel launch");
}

void check_plan_matches(const ArgChecker& check, const DecodePlan& plan, const DecodeShape& shape,
                        const TensorView& q, const TensorView& seq_lens) {
  constexpr const char* kRemake = " (make a plan for this call with mla_decode_plan)";
  check.require(plan.made, "plan must come from mla_decode_plan, got a default-constructed DecodePlan");
  check.require(plan.batch == shape.batch, "plan was made for a batch of ", plan.batch, " requests, got q.shape[0] = ",
                shape.batch, kRemake);
  check.require(plan.num_heads == shape.heads, "plan was made for ", plan.num_heads, " heads, got q.shape[2] = ",
                shape.heads, kRemake);
  check.require(plan.q_len == shape.q_len, "plan was made for q_len ", plan.q_len, ", got q.shape[1] = ", shape.q_len,
                kRemake);
  check.require(plan.dtype == q.dtype, "plan was made for ", dtype_name(plan.dtype), " q and kv_cache, got ",
                dtype_name(q.dtype), kRemake);
  check.require(plan.max_pages == shape.max_pages, "plan was made for a block table of ", plan.max_pages,
                " pages per request, got block_table.shape[1] = ", shape.max_pages, kRemake);
  check.require(plan.page_size == shape.page_size, "plan was made for page_size ", plan.page_size,
                ", got kv_cache.shape[1] = ", shape.page_size, kRemake);
  check.require(plan.device == q.device, "plan was made on ", device_of(plan.device), ", got tensors on ",
                device_of(q.device), kRemake);
  check.require(plan.num_sms == shape.num_sms, "plan was made for ", plan.num_sms, " multiprocessors, the device has ",
                shape.num_sms, kRemake);
  check.require(plan.seq_lens == seq_lens.data,
                "seq_lens must be the tensor the plan was made from (the plan follows its values)", kRemake);
}

}  // namespace detail

DecodePlan mla_decode_plan(const TensorView& seq_lens, const TensorView& block_table, int64_t num_heads,
                           int64_t q_len, DType dtype, int64_t page_size, const std::optional<TensorView>& workspace,
                           int64_t invariant_split_tokens, Stream stream) {
  const detail::ArgChecker check("mla_decode_plan");
  check.defined(seq_lens, "seq_lens", 1);
  check.dtype(seq_lens, "seq_lens", {DType::kInt32});
  check.contiguous(seq_lens, "seq_lens");
  const int64_t batch = seq_lens.shape[0];
  check.defined(block_table, "block_table", 2);
  check.dtype(block_table, "block_table", {DType::kInt32});
  check.dim(block_table, "block_table", 0, batch);
  check.same_device(block_table, "block_table", seq_lens.device);
  check_heads_and_q_len(check, num_heads, q_len);
  check.require(dtype == DType::kFloat8E4M3 || dtype == DType::kBFloat16,
                "dtype must be float8_e4m3fn or bfloat16 (the dtype of q and kv_cache), got ", dtype_name(dtype));
  check.require(page_size >= 1, "page_size must be >= 1, got ", page_size);
  const int64_t split_blocks = split_blocks_of(check, invariant_split_tokens);
  if (workspace) {
    check.defined(*workspace, "workspace", workspace->ndim);
    check.same_device(*workspace, "workspace", seq_lens.device);
  }
  DecodePlan plan;
  plan.made = true;
  plan.batch = batch;
  plan.num_heads = num_heads;
  plan.q_len = q_len;
  plan.max_pages = block_table.shape[1];
  plan.page_size = page_size;
  plan.dtype = dtype;
  plan.device = seq_lens.device;
  plan.invariant_split_tokens = invariant_split_tokens;
  plan.seq_lens = seq_lens.data;
  plan.workspace = workspace;
  if (!seq_lens.is_cuda() || batch == 0) return plan;  // the CPU reference needs no plan; nothing to plan

  // The GPU checks of mla_decode that concern the plan, then the workspace of its policy.
  check.require(decode_page_size_supported(page_size), "page_size must be a power of two in [1, 128] on the GPU, got ",
                page_size);
  const int64_t max_tokens = plan.max_pages * page_size;
  check.require(max_tokens < (int64_t{1} << 31), "block_table.shape[1] * page_size must be < 2^31 tokens, got ",
                max_tokens);
  const int64_t blocks = planned_blocks(max_tokens, split_blocks);
  check.require(batch <= (kMaxDecodeBlocks - 1) / blocks, "seq_lens.shape[0] (batch) times the blocks of 64 tokens a "
                "block_table row can hold (", blocks, ", rounded up to whole pieces) must be < 2^30 on the GPU, got ",
                batch);
  detail::require_sm90(check, seq_lens.device);
  plan.num_sms = device_sm_count(seq_lens.device.index);
  const dk::WorkspaceLayout layout =
      dk::workspace_layout(batch, num_heads, q_len, plan.num_sms, split_blocks, blocks);
  const TensorView& ws = detail::require_workspace(
      check, workspace, layout.total_bytes,
      {{batch, num_heads, q_len, plan.num_sms, max_tokens, invariant_split_tokens}});
  check.disjoint(ws, "workspace", seq_lens, "seq_lens");
  check.disjoint(ws, "workspace", block_table, "block_table");

  detail::DeviceGuard guard(seq_lens.device, check.function());
  dk::DecodeLaunch launch{};
  launch.fp8 = dtype == DType::kFloat8E4M3;
  launch.batch = static_cast<int>(batch);
  launch.q_len = static_cast<int>(q_len);
  launch.num_heads = static_cast<int>(num_heads);
  launch.page_size = static_cast<int>(page_size);
  launch.max_pages = static_cast<int>(plan.max_pages);
  launch.seq_lens = seq_lens.ptr<int32_t>();
  launch.workspace = ws.data;
  launch.layout = layout;
  launch.split_units = static_cast<int>(split_blocks);
  const dk::DecodeLaunchStatus status =
      dk::run_decode(launch, reinterpret_cast<cudaStream_t>(stream), dk::DecodeSteps::kPlan);
  detail::check_cuda(status.cuda, check.function(), "the planner's launch");
  return plan;
}

void mla_decode_with_plan(const DecodePlan& plan, const TensorView& q, const TensorView& kv_cache,
                          const TensorView& block_table, const TensorView& seq_lens, const TensorView& out,
                          const std::optional<TensorView>& lse, float softmax_scale, float output_scale,
                          Stream stream) {
  const detail::ArgChecker check("mla_decode_with_plan");
  check.require(plan.made, "plan must come from mla_decode_plan, got a default-constructed DecodePlan");
  const detail::DecodeShape shape = detail::validate_decode(check, q, kv_cache, block_table, seq_lens, out, lse,
                                                            plan.workspace, softmax_scale, output_scale);
  detail::check_plan_matches(check, plan, shape, q, seq_lens);
  detail::run_decode_validated(check, shape, q, kv_cache, block_table, seq_lens, out, lse, plan.workspace,
                               softmax_scale, output_scale, stream, std::nullopt, &plan);
}

void mla_decode(const TensorView& q, const TensorView& kv_cache, const TensorView& block_table,
                const TensorView& seq_lens, const TensorView& out, const std::optional<TensorView>& lse,
                const std::optional<TensorView>& workspace, float softmax_scale, float output_scale, Stream stream,
                const std::optional<DecodeContextParallel>& context_parallel) {
  const detail::ArgChecker check("mla_decode");
  const detail::DecodeShape shape = detail::validate_decode(check, q, kv_cache, block_table, seq_lens, out, lse,
                                                            workspace, softmax_scale, output_scale, context_parallel);
  detail::run_decode_validated(check, shape, q, kv_cache, block_table, seq_lens, out, lse, workspace, softmax_scale,
                               output_scale, stream, context_parallel);
}

}  // namespace speedmla
