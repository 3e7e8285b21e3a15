// MlaBackend: configuration checks, per-batch metadata, CUDA-graph state and the forward passes.
// Validation happens here; the work is done by the public operations and the metadata kernels.
// forward_decode checks each tensor once and then runs the validated halves of quantize_fp8,
// mla_decode and kv_cache_write (api/*_internal.h; docs/architecture.md says why).
#include "speedmla/backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include "api/cache_internal.h"
#include "api/check.h"
#include "api/decode_internal.h"
#include "api/quantize_internal.h"
#include "backend/device_buffer.h"
#include "backend/page_table.h"
#include "backend/views.h"
#include "backend/workspace.h"
#include "kernels/backend/page_table.h"
#include "speedmla/cache.h"
#include "speedmla/decode.h"
#include "speedmla/merge.h"
#include "speedmla/prefill.h"
#include "speedmla/quantize.h"

namespace speedmla {

using detail::ArgChecker;
using detail::DeviceBuffer;

const char* forward_mode_name(ForwardMode mode) {
  switch (mode) {
    case ForwardMode::kDecode: return "decode";
    case ForwardMode::kExtend: return "extend";
    case ForwardMode::kMixed: return "mixed";
  }
  return "unknown";
}

// The block-table width must be a multiple of this many tokens' worth of pages (TokenSpeed's
// TRTLLM_BLOCK_CONSTRAINT), so tables of different page sizes cover the same token spans.
inline constexpr int64_t kBlockTableTokenMultiple = 128;

int64_t padded_block_table_width(int64_t context_len, int64_t page_size) {
  const ArgChecker c("padded_block_table_width");
  c.require(context_len >= 1, "context_len must be >= 1, got ", context_len);
  c.require(page_size >= 1, "page_size must be >= 1, got ", page_size);
  const int64_t pages = (context_len + page_size - 1) / page_size;
  const int64_t multiple = std::max<int64_t>(1, kBlockTableTokenMultiple / page_size);
  return (pages + multiple - 1) / multiple * multiple;
}

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr size_t kBufferAlignment = 256;

size_t align_up(size_t bytes, size_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

void validate_config(const MlaBackendConfig& config) {
  const ArgChecker c("MlaBackend");
  c.require(config.num_heads >= 1, "config.num_heads must be >= 1, got ", config.num_heads);
  c.require(config.tp_size >= 1, "config.tp_size must be >= 1, got ", config.tp_size);
  c.require(config.num_heads % config.tp_size == 0, "config.num_heads (", config.num_heads,
            ") must be a multiple of config.tp_size (", config.tp_size, ")");
  const int64_t heads = config.num_local_heads();
  c.require(heads <= kMaxDecodeHeads, "heads per rank num_heads / tp_size must be <= ",
            kMaxDecodeHeads, ", got ", config.num_heads, " / ", config.tp_size, " = ", heads);
  c.require(config.kv_cache_dtype == DType::kFloat8E4M3 || config.kv_cache_dtype == DType::kBFloat16,
            "config.kv_cache_dtype must be float8_e4m3fn or bfloat16, got ",
            dtype_name(config.kv_cache_dtype));
  c.require(decode_page_size_supported(config.page_size),
            "config.page_size must be one the decode kernels support (a power of two from 1 to 128), got ",
            config.page_size);
  if (config.seed_compatible) {
    c.require(config.page_size == 32 || config.page_size == 64,
              "config.seed_compatible requires page_size 32 or 64 (as tokenspeed_mla), got ",
              config.page_size);
    c.require(config.kv_cache_dtype == DType::kFloat8E4M3,
              "config.seed_compatible requires a float8_e4m3fn KV cache (as tokenspeed_mla, "
              "--kv-cache-dtype fp8_e4m3), got ", dtype_name(config.kv_cache_dtype));
  }
  c.require(config.context_len >= 1 && config.context_len <= kInt32Max,
            "config.context_len must be in [1, 2^31 - 1] tokens, got ", config.context_len);
  c.require(config.max_batch >= 1, "config.max_batch must be >= 1, got ", config.max_batch);
  c.require(config.max_graph_batch >= 0, "config.max_graph_batch must be >= 0 (0 disables CUDA "
            "graphs), got ", config.max_graph_batch);
  c.require(config.num_draft_tokens >= 0, "config.num_draft_tokens must be >= 0, got ",
            config.num_draft_tokens);
  c.require(config.invariant_split_tokens >= 0 && config.invariant_split_tokens % 64 == 0 &&
                config.invariant_split_tokens <= kInt32Max,
            "config.invariant_split_tokens must be 0 (balanced decode) or a positive multiple of 64 below "
            "2^31, got ", config.invariant_split_tokens);
  c.require(config.chunked_prefill_capacity >= 1 && config.chunked_prefill_capacity <= kInt32Max,
            "config.chunked_prefill_capacity must be in [1, 2^31 - 1] tokens, got ",
            config.chunked_prefill_capacity);
  if (config.device.kind == DeviceKind::kCUDA) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      count = 0;
    }
    c.require(config.device.index >= 0 && config.device.index < count, "config.device ",
              detail::device_of(config.device), " does not exist (", count, " CUDA devices visible)");
  }
}

// An int32 tensor of host lengths: [n], on the CPU.
std::vector<int32_t> read_host_lens(const ArgChecker& c, const TensorView& t, const char* name,
                                    int64_t n) {
  c.defined(t, name, 1);
  c.dtype(t, name, {DType::kInt32});
  c.require(!t.is_cuda(), name, " must be a CPU tensor (the engine's *_cpu copy), got ",
            detail::device_of(t.device));
  c.dim(t, name, 0, n);
  std::vector<int32_t> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    values[i] = t.ptr<const int32_t>()[i * t.strides[0]];
    c.require(values[i] >= 0, name, "[", i, "] must be >= 0, got ", values[i]);
  }
  return values;
}

// Checks a [rows, ...] int32 lengths tensor of the engine on `device`.
void check_seq_lens(const ArgChecker& c, const TensorView& seq_lens, const char* name,
                    int64_t rows, Device device) {
  c.defined(seq_lens, name, 1);
  c.dtype(seq_lens, name, {DType::kInt32});
  c.same_device(seq_lens, name, device);
  c.require(seq_lens.shape[0] >= rows, name, " must hold at least ", rows, " entries, got shape ",
            detail::shape_of(seq_lens));
}

// `t` as [bs, q_len, ...]: a 4-D (3-D for lse) tensor as is, or one dimension fewer with its
// rows split into bs requests of q_len tokens.
TensorView as_batched(const ArgChecker& c, const TensorView& t, const char* name, int batched_ndim,
                      int64_t bs, int64_t q_len) {
  if (t.ndim == batched_ndim - 1) {
    c.require(t.shape[0] == bs * q_len, name, ".shape[0] must be bs * q_len = ", bs * q_len,
              ", got ", t.shape[0]);
    return detail::split_rows(t, bs, q_len);
  }
  c.require(t.ndim == batched_ndim, name, " must have ", batched_ndim - 1, " or ", batched_ndim,
            " dimensions, got shape ", detail::shape_of(t));
  c.dim(t, name, 0, bs);
  c.dim(t, name, 1, q_len);
  return t;
}

}  // namespace

struct MlaBackend::Impl {
  explicit Impl(const MlaBackendConfig& c) : config(c), workspaces(c.device) {}
  MlaBackendConfig config;
  detail::BackendWorkspaces workspaces;  // decode scratch: per stream, and for graphs
  int64_t width = 0;  // block-table width
  std::shared_ptr<DeviceBuffer> decode_table;  // [max_batch, width]
  std::optional<DecodeMetadata> decode;
  std::optional<ExtendMetadata> extend;
  std::shared_ptr<DeviceBuffer> extend_storage;  // grow-only; see build_extend
  // The decode step's split-KV plan (GPU), made by the step's first forward_decode; dropped when
  // the metadata changes.
  std::optional<DecodePlan> plan;

  struct GraphState {
    int64_t max_bs = 0;
    std::shared_ptr<DeviceBuffer> table;  // [max_bs, width], maybe the target's
    TensorView seq_lens_buf;
    bool aliased = false;
    std::map<int64_t, DecodeMetadata> captured;  // by batch size
    // The plan each graph's decode calls follow (by batch size), remade before each replay.
    std::map<int64_t, DecodePlan> plans;
  };
  std::optional<GraphState> graph;

  int64_t max_rows() const { return std::max(config.max_batch, config.max_graph_batch); }
  // Bytes of mla_decode's workspace (GPU) for `batch` requests of `q_len` tokens, in the
  // configured split policy, aligned for what follows it.
  size_t decode_workspace_bytes(int64_t batch, int64_t q_len) const {
    return align_up(mla_decode_workspace_size(batch, config.num_local_heads(), q_len,
                                              device_sm_count(config.device.index), width * config.page_size,
                                              config.invariant_split_tokens),
                    kBufferAlignment);
  }

  void build_extend(const ArgChecker& c, int64_t num_extends, const ExtendLens& lens,
                    const TensorView& req_pool_indices, const TensorView& req_to_page,
                    Stream stream);
};

// All extend metadata lives in one buffer, laid out as
//   int32: cu_seq_lens[n+1] | cu_extend_seq_lens[n+1] | chunk cu_seq_lens[loops][n+1]
//   int64 (aligned): ranges[R][4] | slots[total prefix tokens]
// The host builds everything but the slots, uploads it in one copy, and the slot kernel reads the
// ranges from the device. The buffer is reused while large enough; a larger batch replaces it.
void MlaBackend::Impl::build_extend(const ArgChecker& c, int64_t n, const ExtendLens& lens,
                                    const TensorView& req_pool_indices,
                                    const TensorView& req_to_page, Stream stream) {
  const std::vector<int32_t> prefix = read_host_lens(c, lens.prefix_lens, "extend.prefix_lens", n);
  const std::vector<int32_t> fresh = read_host_lens(c, lens.extend_lens, "extend.extend_lens", n);
  c.defined(req_to_page, "req_to_page", 2);
  const int64_t pool_tokens = req_to_page.shape[1] * config.page_size;
  int64_t total = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t len = int64_t{prefix[b]} + fresh[b];
    c.require(len <= config.context_len, "extend request ", b, " has ", prefix[b],
              " prefix + ", fresh[b], " new tokens, more than config.context_len = ",
              config.context_len);
    c.require(prefix[b] <= pool_tokens, "extend request ", b, " has a prefix of ", prefix[b],
              " tokens but req_to_page rows hold only ", req_to_page.shape[1], " pages of ",
              config.page_size);
    total += len;
  }
  c.require(total <= kInt32Max, "the extend requests hold ", total,
            " tokens, more than int32 cu_seqlens can count");

  ChunkedPrefillPlan plan = plan_chunked_prefill(prefix, config.chunked_prefill_capacity);
  const int64_t loops = plan.num_loops, row = n + 1;
  std::vector<int32_t> lists(static_cast<size_t>((2 + loops) * row), 0);
  int32_t max_fresh = 0;
  for (int64_t b = 0; b < n; ++b) {
    lists[b + 1] = lists[b] + prefix[b] + fresh[b];
    lists[row + b + 1] = lists[row + b] + fresh[b];
    max_fresh = std::max(max_fresh, fresh[b]);
  }
  std::vector<int64_t> ranges;  // {row, first position, count, first output}
  int64_t slots_before = 0;
  for (int64_t loop = 0; loop < loops; ++loop) {
    const std::vector<int32_t>& cu = plan.cu_seq_lens[loop];
    std::copy(cu.begin(), cu.end(), lists.begin() + (2 + loop) * row);
    for (int64_t b = 0; b < n; ++b)
      if (cu[b + 1] > cu[b])
        ranges.insert(ranges.end(), {b, plan.loop_begin(loop), cu[b + 1] - cu[b],
                                     slots_before + cu[b]});
    slots_before += cu[n];
  }
  const int64_t num_ranges = static_cast<int64_t>(ranges.size()) / kernels::kRangeFields;
  c.require(num_ranges <= kInt32Max, "the chunk plan has too many ranges (", num_ranges, ")");

  const size_t list_bytes = lists.size() * sizeof(int32_t);
  const size_t ranges_offset = align_up(list_bytes, sizeof(int64_t));
  const size_t slots_offset = ranges_offset + ranges.size() * sizeof(int64_t);
  const size_t bytes = slots_offset + static_cast<size_t>(plan.total_tokens) * sizeof(int64_t);
  if (!extend_storage || extend_storage->size() < bytes)
    extend_storage = std::make_shared<DeviceBuffer>(config.device, bytes,
                                                    DeviceBuffer::Fill::kUninitialized, c.function());
  std::vector<char> staging(slots_offset, 0);
  std::memcpy(staging.data(), lists.data(), list_bytes);
  std::memcpy(staging.data() + ranges_offset, ranges.data(), ranges.size() * sizeof(int64_t));
  extend_storage->upload(0, staging.data(), staging.size(), stream, c.function());
  const TensorView range_view =
      extend_storage->view(DType::kInt64, {num_ranges, kernels::kRangeFields}, ranges_offset);
  const TensorView all_slots = extend_storage->view(DType::kInt64, {plan.total_tokens}, slots_offset);
  detail::build_range_slots(c.function(), req_to_page, req_pool_indices, n, range_view,
                            config.page_size, all_slots, stream);

  ExtendMetadata md;
  md.num_extends = n;
  md.max_seq_len = config.context_len;
  md.max_extend_seq_len = max_fresh;
  md.cu_seq_lens = extend_storage->view(DType::kInt32, {row}, 0);
  md.cu_extend_seq_lens = extend_storage->view(DType::kInt32, {row}, row * sizeof(int32_t));
  int64_t slot_offset = 0;
  for (int64_t loop = 0; loop < loops; ++loop) {
    md.chunk_cu_seq_lens.push_back(
        extend_storage->view(DType::kInt32, {row}, (2 + loop) * row * sizeof(int32_t)));
    const int64_t tokens = plan.cu_seq_lens[loop][n];
    md.chunk_slots.push_back(detail::slice_rows(all_slots, slot_offset, tokens));
    slot_offset += tokens;
  }
  md.chunks = std::move(plan);
  md.storage = extend_storage;
  extend = std::move(md);
}

MlaBackend::MlaBackend(const MlaBackendConfig& config) {
  validate_config(config);
  impl_ = std::make_unique<Impl>(config);
  impl_->width = padded_block_table_width(config.context_len, config.page_size);
  impl_->decode_table = std::make_shared<DeviceBuffer>(
      config.device, static_cast<size_t>(config.max_batch * impl_->width) * sizeof(int32_t),
      DeviceBuffer::Fill::kZero, "MlaBackend");
}

MlaBackend::~MlaBackend() = default;

const MlaBackendConfig& MlaBackend::config() const { return impl_->config; }
int64_t MlaBackend::block_table_width() const { return impl_->width; }
const DecodeMetadata* MlaBackend::decode_metadata() const {
  return impl_->decode ? &*impl_->decode : nullptr;
}
const ExtendMetadata* MlaBackend::extend_metadata() const {
  return impl_->extend ? &*impl_->extend : nullptr;
}

size_t MlaBackend::workspace_capacity(Stream stream) const { return impl_->workspaces.stream_capacity(stream); }
size_t MlaBackend::graph_workspace_capacity() const { return impl_->workspaces.graph_capacity(); }

size_t MlaBackend::workspace_bytes(int64_t batch, int64_t q_len) const {
  const MlaBackendConfig& cfg = impl_->config;
  const int64_t heads = cfg.num_local_heads();
  size_t bytes = 0;
  if (cfg.device.kind == DeviceKind::kCUDA) bytes = impl_->decode_workspace_bytes(batch, q_len);
  if (cfg.kv_cache_dtype == DType::kFloat8E4M3)
    bytes += static_cast<size_t>(batch * q_len * heads * kCacheRowDim);
  return bytes;
}

void MlaBackend::init_forward_metadata(int64_t bs, int64_t num_extends,
                                       const TensorView& req_pool_indices,
                                       const TensorView& seq_lens, ForwardMode mode,
                                       const TensorView& req_to_page,
                                       const std::optional<ExtendLens>& extend, Stream stream) {
  const ArgChecker c("MlaBackend::init_forward_metadata");
  Impl& s = *impl_;
  c.require(bs >= 1 && bs <= s.config.max_batch, "bs must be in [1, config.max_batch = ",
            s.config.max_batch, "], got ", bs);
  c.require(num_extends >= 0 && num_extends <= bs, "num_extends must be in [0, bs = ", bs,
            "], got ", num_extends);
  c.require(mode != ForwardMode::kDecode || num_extends == 0,
            "a decode batch has no extend requests, got num_extends = ", num_extends);
  c.require(mode != ForwardMode::kExtend || num_extends == bs,
            "an extend batch has num_extends == bs = ", bs, ", got ", num_extends);
  check_seq_lens(c, seq_lens, "seq_lens", bs, s.config.device);
  c.defined(req_pool_indices, "req_pool_indices", 1);
  c.require(req_pool_indices.shape[0] >= bs, "req_pool_indices must hold at least bs = ", bs,
            " entries, got shape ", detail::shape_of(req_pool_indices));

  const bool builds_extend = mode != ForwardMode::kDecode;
  const bool builds_decode = mode != ForwardMode::kExtend || s.config.is_draft;
  if (builds_extend) {
    c.require(extend.has_value(), "an ", forward_mode_name(mode),
              " batch needs the extend requests' host lengths (extend)");
    s.build_extend(c, num_extends, *extend, req_pool_indices, req_to_page, stream);
  }
  if (builds_decode) {
    const TensorView table = s.decode_table->view(DType::kInt32, {bs, s.width});
    detail::build_block_table(c.function(), req_to_page, req_pool_indices, bs, table, stream);
    s.decode = DecodeMetadata{
        .num_extends = num_extends,
        .max_seq_len = s.config.context_len,
        .block_table = table,
        .seq_lens = detail::slice_rows(seq_lens, 0, bs),
        .storage = s.decode_table,
    };
  } else {
    s.decode.reset();
  }
  s.plan.reset();  // new seq_lens: the next forward_decode plans again
  if (!builds_extend) s.extend.reset();  // last: a failed call above keeps the old metadata
}

int64_t MlaBackend::set_num_extends(int64_t num_extends) {
  const ArgChecker c("MlaBackend::set_num_extends");
  c.require(impl_->decode.has_value(), "there is no decode metadata to override; call "
            "init_forward_metadata or a CUDA-graph capture/replay first");
  DecodeMetadata& md = *impl_->decode;
  c.require(num_extends >= 0 && num_extends <= md.block_table.shape[0],
            "num_extends must be in [0, bs = ", md.block_table.shape[0], "], got ", num_extends);
  return std::exchange(md.num_extends, num_extends);
}

MlaBackend::ScopedNumExtends::ScopedNumExtends(MlaBackend& backend, int64_t num_extends)
    : backend_(backend), previous_(backend.set_num_extends(num_extends)) {}

MlaBackend::ScopedNumExtends::~ScopedNumExtends() {
  // Restores onto the current metadata, as the seed does; skipped if metadata replaced inside
  // the scope is too small for the old value (a destructor must not throw).
  std::optional<DecodeMetadata>& md = backend_.impl_->decode;
  if (md && previous_ <= md->block_table.shape[0]) md->num_extends = previous_;
}

MlaBackend::ScopedNumExtends MlaBackend::override_num_extends(int64_t num_extends) {
  return ScopedNumExtends(*this, num_extends);
}

void MlaBackend::init_cuda_graph_state(int64_t max_bs, const TensorView& seq_lens_buf) {
  const ArgChecker c("MlaBackend::init_cuda_graph_state");
  Impl& s = *impl_;
  c.require(s.config.max_graph_batch > 0,
            "CUDA graphs are disabled: set config.max_graph_batch to the largest graph batch");
  c.require(max_bs >= 1 && max_bs <= s.config.max_graph_batch,
            "max_bs must be in [1, config.max_graph_batch = ", s.config.max_graph_batch, "], got ",
            max_bs);
  check_seq_lens(c, seq_lens_buf, "seq_lens_buf", max_bs, s.config.device);
  s.graph = Impl::GraphState{
      .max_bs = max_bs,
      .table = std::make_shared<DeviceBuffer>(
          s.config.device, static_cast<size_t>(max_bs * s.width) * sizeof(int32_t),
          DeviceBuffer::Fill::kZero, c.function()),
      .seq_lens_buf = seq_lens_buf,
      .aliased = false,
      .captured = {},
      .plans = {},
  };
  // The graphs' workspace, before any capture: sized for every graph batch at decode_q_len().
  const size_t bytes = workspace_bytes(max_bs, s.config.decode_q_len());
  s.workspaces.of_graphs().acquire(s.config.device, bytes, bytes, nullptr, c.function());
}

void MlaBackend::alias_cuda_graph_block_table(const MlaBackend& target) {
  const ArgChecker c("MlaBackend::alias_cuda_graph_block_table");
  Impl& s = *impl_;
  const Impl& t = *target.impl_;
  c.require(s.config.is_draft, "only a draft backend (config.is_draft) aliases its target's "
            "block table");
  c.require(&target != this, "a backend cannot alias itself");
  c.require(s.graph.has_value() && t.graph.has_value(),
            "call init_cuda_graph_state on both backends first");
  c.require(s.graph->captured.empty(), "alias before capturing any graph (captured graphs read "
            "the block table they were captured with)");
  c.require(t.config.page_size == s.config.page_size && t.width == s.width,
            "the target's block table must have the same page size and width (page_size ",
            t.config.page_size, " vs ", s.config.page_size, ", width ", t.width, " vs ", s.width,
            ")");
  c.require(t.config.device == s.config.device, "the target must be on the same device");
  c.require(t.graph->max_bs >= s.graph->max_bs, "the target's graph state has ", t.graph->max_bs,
            " rows but this backend needs ", s.graph->max_bs);
  s.graph->table = t.graph->table;
  s.graph->aliased = true;
}

void MlaBackend::init_forward_metadata_capture_cuda_graph(int64_t bs, ForwardMode mode) {
  const ArgChecker c("MlaBackend::init_forward_metadata_capture_cuda_graph");
  Impl& s = *impl_;
  c.require(mode == ForwardMode::kDecode, "CUDA graphs cover decode and verify only, got mode ",
            forward_mode_name(mode));
  c.require(s.graph.has_value(), "call init_cuda_graph_state first");
  c.require(bs >= 1 && bs <= s.graph->max_bs, "bs must be in [1, max_bs = ", s.graph->max_bs,
            "], got ", bs);
  DecodeMetadata md{
      .num_extends = 0,
      .max_seq_len = s.config.context_len,
      .block_table = s.graph->table->view(DType::kInt32, {bs, s.width}),
      .seq_lens = detail::slice_rows(s.graph->seq_lens_buf, 0, bs),
      .storage = s.graph->table,
  };
  s.graph->captured[bs] = md;
  s.graph->plans.erase(bs);
  s.decode = std::move(md);
  s.plan.reset();
}

void MlaBackend::init_forward_metadata_replay_cuda_graph(int64_t bs,
                                                         const TensorView& req_pool_indices,
                                                         const std::optional<TensorView>& req_to_page,
                                                         int64_t num_real, ForwardMode mode,
                                                         Stream stream) {
  const ArgChecker c("MlaBackend::init_forward_metadata_replay_cuda_graph");
  Impl& s = *impl_;
  c.require(mode == ForwardMode::kDecode, "CUDA graphs cover decode and verify only, got mode ",
            forward_mode_name(mode));
  c.require(s.graph.has_value(), "call init_cuda_graph_state first");
  const auto it = s.graph->captured.find(bs);
  c.require(it != s.graph->captured.end(), "no graph was captured for batch size ", bs,
            " (call init_forward_metadata_capture_cuda_graph before capturing it)");
  if (num_real < 0) num_real = bs;
  c.require(num_real <= bs, "num_real must be <= bs = ", bs, ", got ", num_real);
  if (req_to_page && !s.graph->aliased)
    detail::build_block_table(c.function(), *req_to_page, req_pool_indices, num_real,
                              it->second.block_table, stream);
  s.decode = it->second;
  s.plan.reset();
  // The graph's decode calls follow the plan in its workspace: remade here for the new seq_lens
  // (the engine wrote them before this call), in the buffer the graph was captured with.
  const auto planned = s.graph->plans.find(bs);
  if (planned != s.graph->plans.end()) {
    const DecodePlan& old = planned->second;
    const DecodeMetadata& md = it->second;
    s.plan = mla_decode_plan(detail::slice_rows(md.seq_lens, 0, old.batch), detail::slice_rows(md.block_table, 0, old.batch),
                             old.num_heads, old.q_len, old.dtype, old.page_size, old.workspace,
                             old.invariant_split_tokens, stream);
  }
}

void MlaBackend::forward_decode(const TensorView& q, const TensorView& kv_cache, int64_t bs,
                                const TensorView& out, float scaling, float k_scale,
                                const std::optional<NewTokenKv>& new_kv,
                                const std::optional<TensorView>& lse, Stream stream) {
  const ArgChecker c("MlaBackend::forward_decode");
  Impl& s = *impl_;
  c.require(s.decode.has_value(), "there is no decode metadata; call init_forward_metadata "
            "(decode or mixed batch) or a CUDA-graph capture/replay first");
  const DecodeMetadata& md = *s.decode;
  const int64_t decode_rows = md.block_table.shape[0] - md.num_extends;
  c.require(bs >= 1 && bs <= decode_rows, "bs must be in [1, ", decode_rows,
            "] (the metadata's decode rows), got ", bs);
  const int64_t heads = s.config.num_local_heads();
  c.require(q.ndim == 3 || q.ndim == 4, "q must be [bs*q_len, H, 576] or [bs, q_len, H, 576], "
            "got shape ", detail::shape_of(q));
  c.require(q.shape[0] % bs == 0, "q.shape[0] = ", q.shape[0], " must be a multiple of bs = ", bs);
  const int64_t q_len = q.ndim == 3 ? q.shape[0] / bs : q.shape[1];
  c.require(q_len >= 1, "q must hold at least one token per request, got shape ", detail::shape_of(q));
  const TensorView q4 = as_batched(c, q, "q", 4, bs, q_len);
  c.dim(q4, "q", 2, heads);
  c.dim(q4, "q", 3, kCacheRowDim);
  const TensorView out4 = as_batched(c, out, "out", 4, bs, q_len);
  std::optional<TensorView> lse3;
  if (lse) lse3 = as_batched(c, *lse, "lse", 3, bs, q_len);
  c.defined(kv_cache, "kv_cache", 3);
  c.dtype(kv_cache, "kv_cache", {s.config.kv_cache_dtype});
  c.dim(kv_cache, "kv_cache", 1, s.config.page_size);

  const bool fp8 = s.config.kv_cache_dtype == DType::kFloat8E4M3;
  c.require(!fp8 || (k_scale > 0 && k_scale < std::numeric_limits<float>::infinity()),
            "k_scale must be positive and finite, got ", k_scale);
  // Named as the engine passes it: mla_decode's own check would name softmax_scale.
  c.require(scaling > 0 && scaling < std::numeric_limits<float>::infinity(), "scaling must be positive and finite, got ",
            scaling);
  // Workspace: the decode bound for this batch (GPU), then room for FP8 queries. Acquired before
  // anything is launched, so that a call refused during capture leaves no work. Metadata from a
  // graph capture or replay uses the graphs' buffer, other calls their stream's (workspace.h);
  // a buffer that must grow is sized for the largest batch at once.
  const bool gpu = s.config.device.kind == DeviceKind::kCUDA;
  const bool quantize = fp8 && q4.dtype != DType::kFloat8E4M3;
  const size_t decode_bytes = gpu ? s.decode_workspace_bytes(bs, q_len) : 0;
  const size_t needed = decode_bytes + (quantize ? static_cast<size_t>(bs * q_len * heads * kCacheRowDim) : 0);
  TensorView workspace{};
  if (needed > 0) {
    detail::GrowingBuffer& buffer = s.graph && md.storage == s.graph->table ? s.workspaces.of_graphs()
                                                                             : s.workspaces.of_stream(stream);
    const size_t grow_to = buffer.capacity() < needed ? workspace_bytes(std::max(bs, s.max_rows()), q_len) : needed;
    workspace = buffer.acquire(s.config.device, needed, grow_to, stream, c.function());
  }
  TensorView new_rows{};
  if (new_kv) {
    new_rows = new_kv->kv;
    c.require(new_rows.ndim == 2 || (new_rows.ndim == 3 && new_rows.shape[1] == 1),
              "new_kv.kv must be [T, 576] or [T, 1, 576], got shape ", detail::shape_of(new_rows));
    if (new_rows.ndim == 3) new_rows = detail::squeeze(new_rows, 1);
    c.dim(new_rows, "new_kv.kv", 1, kCacheRowDim);
  }

  // Every check before any work, each tensor once. The engine's query is checked as
  // quantize_fp8's x (named q) when it is quantised (the FP8 copy in the workspace is built to pass
  // quantize_fp8's checks of out), and the query mla_decode reads, the engine's or the copy, with
  // everything else mla_decode reads, by mla_decode's own validation, under this function's name.
  TensorView query = q4;
  if (quantize) {
    detail::validate_quantize_input(c, q4, "q");
    query = make_view(workspace.ptr<char>() + decode_bytes, DType::kFloat8E4M3, s.config.device,
                      {bs, q_len, heads, kCacheRowDim});
  }
  std::optional<TensorView> decode_workspace;
  if (gpu) decode_workspace = detail::slice_rows(workspace, 0, static_cast<int64_t>(decode_bytes));
  const TensorView block_table = detail::slice_rows(md.block_table, md.num_extends, bs);
  const TensorView seq_lens = detail::slice_rows(md.seq_lens, md.num_extends, bs);
  const float softmax_scale = fp8 ? k_scale * scaling : scaling, output_scale = fp8 ? k_scale : 1.0f;
  const detail::DecodeShape shape =
      detail::validate_decode(c, query, kv_cache, block_table, seq_lens, out4, lse3, decode_workspace,
                              softmax_scale, output_scale);

  // The new KV as kv_cache_write's latent and rope, checked (and named) as by kv_cache_write but
  // for kv_cache, which validate_decode has checked: kv_cache_write's own checks of it are
  // check_cache_layout, FP8 or BF16 (here: the configured dtype) and 16-byte alignment, the one
  // validate_decode makes only on the GPU.
  const detail::ArgChecker write_check("kv_cache_write");
  TensorView latent{}, rope{};
  const float write_scale = fp8 ? 1.0f / k_scale : 1.0f;
  if (new_kv) {
    latent = detail::slice_last(new_rows, 0, kLatentDim);
    rope = detail::slice_last(new_rows, kLatentDim, kRopeDim);
    if (!query.is_cuda()) write_check.aligned(kv_cache, "kv_cache", 16);
    detail::validate_kv_cache_write_inputs(write_check, kv_cache, new_kv->slots, latent, rope, write_scale);
  }

  // The step's plan: reused when made for these rows, this q_len and this workspace (the
  // step's first layer makes it; checked by check_plan_matches like any other plan).
  const DecodePlan* plan = nullptr;
  if (gpu) {
    if (!(s.plan && s.plan->batch == bs && s.plan->q_len == q_len && s.plan->seq_lens == seq_lens.data &&
          s.plan->workspace->data == decode_workspace->data)) {
      s.plan = mla_decode_plan(seq_lens, block_table, heads, q_len, query.dtype, s.config.page_size, decode_workspace,
                               s.config.invariant_split_tokens, stream);
      if (s.graph && md.storage == s.graph->table) s.graph->plans[md.block_table.shape[0]] = *s.plan;
    }
    plan = &*s.plan;
    detail::check_plan_matches(c, *plan, shape, query, seq_lens);
  }

  if (new_kv)
    detail::run_kv_cache_write_validated(write_check, kv_cache, new_kv->slots, latent, rope, write_scale, stream);
  if (quantize) detail::run_quantize_fp8_validated(c, q4, query, 1.0f, stream);
  detail::run_decode_validated(c, shape, query, kv_cache, block_table, seq_lens, out4, lse3,
                               decode_workspace, softmax_scale, output_scale, stream, std::nullopt, plan);
}

void MlaBackend::forward_extend_chunked(const TensorView& q, const TensorView& k,
                                        const TensorView& v, const TensorView& cu_seqlens_q,
                                        const TensorView& cu_seqlens_k, bool causal,
                                        float softmax_scale, const TensorView& out,
                                        const TensorView& lse, Stream stream) {
  forward_extend_chunked(q, k, v, PrefillValueLayout::kTokenMajor, cu_seqlens_q, cu_seqlens_k, causal,
                         softmax_scale, out, lse, stream);
}

void MlaBackend::forward_extend_chunked(const TensorView& q, const TensorView& k, const TensorView& v,
                                        PrefillValueLayout v_layout, const TensorView& cu_seqlens_q,
                                        const TensorView& cu_seqlens_k, bool causal, float softmax_scale,
                                        const TensorView& out, const TensorView& lse, Stream stream) {
  const ArgChecker c("MlaBackend::forward_extend_chunked");
  c.defined(q, "q", 3);
  c.dim(q, "q", 1, impl_->config.num_local_heads());
  mla_prefill(q, k, v, v_layout, cu_seqlens_q, cu_seqlens_k, out, lse, causal, softmax_scale, 1.0f, stream);
}

void MlaBackend::attend_cached_prefix(const TensorView& q, const TensorView& kv_cache,
                                      float k_scale, const PrefixExpander& expand,
                                      const PrefixScratch& scratch, const TensorView& out,
                                      const TensorView& lse, float softmax_scale, Stream stream) {
  const ArgChecker c("MlaBackend::attend_cached_prefix");
  const Impl& s = *impl_;
  c.require(s.extend.has_value(), "there is no extend metadata; call init_forward_metadata "
            "with an extend or mixed batch first");
  c.require(static_cast<bool>(expand), "expand must be a callable");
  const ExtendMetadata& md = *s.extend;
  const int64_t heads = s.config.num_local_heads();
  c.defined(q, "q", 3);
  c.dim(q, "q", 1, heads);
  c.defined(out, "out", 3);
  const int64_t total_q = out.shape[0];
  const int64_t rows = md.chunks.max_loop_tokens;
  auto check_rows = [&](const TensorView& t, const char* name, int ndim, int64_t needed) {
    c.defined(t, name, ndim);
    c.require(t.shape[0] >= needed, name, " must have at least ", needed, " rows, got shape ",
              detail::shape_of(t));
  };
  check_rows(scratch.latent, "scratch.latent", 2, rows);
  check_rows(scratch.k, "scratch.k", 3, rows);
  const bool transposed = scratch.v_layout == PrefillValueLayout::kFp8Transposed;
  if (transposed) {
    c.defined(scratch.v, "scratch.v", 3);
    c.require(scratch.v.shape[2] >= rows, "scratch.v (kFp8Transposed) must have at least ", rows,
              " token positions, got shape ", detail::shape_of(scratch.v));
  } else {
    check_rows(scratch.v, "scratch.v", 3, rows);
  }
  check_rows(scratch.out, "scratch.out", 3, total_q);
  check_rows(scratch.lse, "scratch.lse", 2, total_q);
  c.require(scratch.k.is_contiguous() && scratch.v.is_contiguous(),
            "scratch.k and scratch.v must be contiguous");

  const TensorView partial_out = detail::slice_rows(scratch.out, 0, total_q);
  const TensorView partial_lse = detail::slice_rows(scratch.lse, 0, total_q);
  for (int64_t loop = 0; loop < md.chunks.num_loops; ++loop) {
    const int64_t tokens = md.chunks.cu_seq_lens[loop][md.num_extends];
    const TensorView latent = detail::slice_rows(scratch.latent, 0, tokens);
    const TensorView k = detail::slice_rows(scratch.k, 0, tokens);
    const TensorView v = transposed ? scratch.v : detail::slice_rows(scratch.v, 0, tokens);
    gather_cache(kv_cache, md.chunk_slots[loop], latent, k_scale, stream);
    expand(latent, k, v);
    mla_prefill(q, k, v, scratch.v_layout, md.cu_extend_seq_lens, md.chunk_cu_seq_lens[loop], partial_out,
                partial_lse, /*causal=*/false, softmax_scale, 1.0f, stream);
    merge_attn_states(out, lse, partial_out, partial_lse, out, lse, stream);
  }
}

}  // namespace speedmla
