// The Python face of speedmla: every public operation and the MlaBackend, exported through the
// apache-tvm-ffi C ABI (loaded by python/speedmla/_native.py with tvm_ffi.load_module).
//
// Tensors arrive as DLPack views (PyTorch, NumPy or any DLPack producer; no copy), the CUDA
// stream is the caller's current one (tvm_ffi records PyTorch's current stream for the call),
// and the module links no Python library, so one build serves every Python version.
// speedmla::Error becomes the Python exception speedmla.Error.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/object.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "speedmla/backend.h"
#include "speedmla/speedmla.h"

namespace {

namespace ffi = tvm::ffi;
using speedmla::DType;

// Runs `body`, turning speedmla::Error into the FFI error kind Python maps to speedmla.Error.
// `function` names the operation in errors that arise before it is called: converting an
// argument (from_dlpack names only the argument) is the binding's work, not the caller's.
template <typename Body>
auto translating_errors(const char* function, const Body& body) -> decltype(body()) {
  try {
    return body();
  } catch (const speedmla::Error& e) {
    constexpr std::string_view kConversion = "from_dlpack: ";
    std::string message = e.what();
    if (message.rfind(kConversion, 0) == 0) message = function + (": " + message.substr(kConversion.size()));
    throw ffi::Error("speedmla.Error", message, "");
  }
}

speedmla::TensorView view(const ffi::TensorView& t, const char* name) {
  DLTensor dl{};
  dl.data = t.data_ptr();
  dl.device = t.device();
  dl.ndim = t.ndim();
  dl.dtype = t.dtype();
  dl.shape = const_cast<int64_t*>(t.shape().data());
  dl.strides = const_cast<int64_t*>(t.strides().data());
  dl.byte_offset = t.byte_offset();
  return speedmla::from_dlpack(dl, name);
}

std::optional<speedmla::TensorView> view(const ffi::Optional<ffi::TensorView>& t, const char* name) {
  if (!t.has_value()) return std::nullopt;
  return view(*t, name);
}

// The caller's current stream on a tensor's device: what tvm_ffi set for this call (PyTorch's
// current stream when a CUDA torch.Tensor is an argument), the legacy stream otherwise.
speedmla::Stream stream_of(speedmla::Device device) {
  if (device.kind != speedmla::DeviceKind::kCUDA) return nullptr;
  return static_cast<speedmla::Stream>(TVMFFIEnvGetStream(kDLCUDA, device.index));
}

DLDataType dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3: return {kDLFloat8_e4m3fn, 8, 1};
    case DType::kBFloat16: return {kDLBfloat, 16, 1};
    case DType::kFloat16: return {kDLFloat, 16, 1};
    case DType::kFloat32: return {kDLFloat, 32, 1};
    case DType::kInt32: return {kDLInt, 32, 1};
    case DType::kInt64: return {kDLInt, 64, 1};
    case DType::kUInt8: return {kDLUInt, 8, 1};
  }
  return {kDLUInt, 8, 1};
}

DLDevice dlpack_device(speedmla::Device device) {
  return device.kind == speedmla::DeviceKind::kCUDA ? DLDevice{kDLCUDA, device.index}
                                                    : DLDevice{kDLCPU, 0};
}

// An FFI tensor over memory someone else owns; `owner` (may be empty) is kept alive with it.
struct BorrowedMemory {
  void* data;
  std::shared_ptr<const void> owner;
  void AllocData(DLTensor* tensor) { tensor->data = data; }
  void FreeData(DLTensor*) {}
};

ffi::Tensor borrow(const speedmla::TensorView& t, std::shared_ptr<const void> owner) {
  return ffi::Tensor::FromNDAllocStrided(
      BorrowedMemory{t.data, std::move(owner)}, ffi::ShapeView(t.shape.data(), t.ndim),
      ffi::ShapeView(t.strides.data(), t.ndim), dlpack_dtype(t.dtype), dlpack_device(t.device));
}

// ---- operations (contract §4) ------------------------------------------------------------------

void mla_decode(ffi::TensorView q, ffi::TensorView kv_cache, ffi::TensorView block_table,
                ffi::TensorView seq_lens, ffi::TensorView out, ffi::Optional<ffi::TensorView> lse,
                ffi::Optional<ffi::TensorView> workspace, double softmax_scale,
                double output_scale, ffi::Optional<ffi::TensorView> causal_seqs, int64_t cp_world,
                int64_t cp_rank) {
  translating_errors("mla_decode", [&] {
    const speedmla::TensorView q_view = view(q, "q");
    std::optional<speedmla::DecodeContextParallel> context_parallel;
    if (causal_seqs.has_value()) {
      // Saturated: a value outside int is outside mla_decode's ranges too, and refused there.
      const auto narrow = [](int64_t v) {
        return static_cast<int>(std::clamp<int64_t>(v, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
      };
      context_parallel = speedmla::DecodeContextParallel{view(*causal_seqs, "causal_seqs"), narrow(cp_world),
                                                         narrow(cp_rank)};
    } else if (cp_world != 1 || cp_rank != 0) {
      throw speedmla::Error("mla_decode: cp_world = " + std::to_string(cp_world) + ", cp_rank = " +
                            std::to_string(cp_rank) +
                            " needs causal_seqs (the requests' global KV lengths, [B] int32)");
    }
    speedmla::mla_decode(q_view, view(kv_cache, "kv_cache"), view(block_table, "block_table"),
                         view(seq_lens, "seq_lens"), view(out, "out"), view(lse, "lse"),
                         view(workspace, "workspace"), static_cast<float>(softmax_scale),
                         static_cast<float>(output_scale), stream_of(q_view.device), context_parallel);
  });
}

// The Python face passes the value layout as a flag: v_layout="fp8_transposed" (speedmla.ops).
speedmla::PrefillValueLayout value_layout(bool v_transposed) {
  return v_transposed ? speedmla::PrefillValueLayout::kFp8Transposed : speedmla::PrefillValueLayout::kTokenMajor;
}

// v_transposed: v in speedmla::PrefillValueLayout::kFp8Transposed.
void mla_prefill(ffi::TensorView q, ffi::TensorView k, ffi::TensorView v, bool v_transposed,
                 ffi::TensorView cu_seqlens_q, ffi::TensorView cu_seqlens_k, ffi::TensorView out,
                 ffi::Optional<ffi::TensorView> lse, bool causal, double softmax_scale,
                 double output_scale) {
  translating_errors("mla_prefill", [&] {
    const speedmla::TensorView q_view = view(q, "q");
    speedmla::mla_prefill(q_view, view(k, "k"), view(v, "v"),
                          value_layout(v_transposed),
                          view(cu_seqlens_q, "cu_seqlens_q"),
                          view(cu_seqlens_k, "cu_seqlens_k"), view(out, "out"), view(lse, "lse"),
                          causal, static_cast<float>(softmax_scale),
                          static_cast<float>(output_scale), stream_of(q_view.device));
  });
}

void merge_attn_states(ffi::TensorView out_a, ffi::TensorView lse_a, ffi::TensorView out_b,
                       ffi::TensorView lse_b, ffi::TensorView out,
                       ffi::Optional<ffi::TensorView> lse) {
  translating_errors("merge_attn_states", [&] {
    const speedmla::TensorView a = view(out_a, "out_a");
    speedmla::merge_attn_states(a, view(lse_a, "lse_a"), view(out_b, "out_b"),
                                view(lse_b, "lse_b"), view(out, "out"), view(lse, "lse"),
                                stream_of(a.device));
  });
}

void kv_cache_write(ffi::TensorView kv_cache, ffi::TensorView slots, ffi::TensorView latent,
                    ffi::TensorView rope, double scale_inv) {
  translating_errors("kv_cache_write", [&] {
    const speedmla::TensorView cache = view(kv_cache, "kv_cache");
    speedmla::kv_cache_write(cache, view(slots, "slots"), view(latent, "latent"),
                             view(rope, "rope"), static_cast<float>(scale_inv),
                             stream_of(cache.device));
  });
}

void gather_cache(ffi::TensorView kv_cache, ffi::TensorView slots, ffi::TensorView out,
                  double scale) {
  translating_errors("gather_cache", [&] {
    const speedmla::TensorView cache = view(kv_cache, "kv_cache");
    speedmla::gather_cache(cache, view(slots, "slots"), view(out, "out"),
                           static_cast<float>(scale), stream_of(cache.device));
  });
}

void quantize_fp8(ffi::TensorView x, ffi::TensorView out, double scale_inv) {
  translating_errors("quantize_fp8", [&] {
    const speedmla::TensorView x_view = view(x, "x");
    speedmla::quantize_fp8(x_view, view(out, "out"), static_cast<float>(scale_inv),
                           stream_of(x_view.device));
  });
}

// v_transposed: v_out in speedmla::PrefillValueLayout::kFp8Transposed.
void pack_prefill_kv(ffi::TensorView k_nope, ffi::TensorView k_rope, ffi::TensorView v,
                     ffi::TensorView k_out, ffi::TensorView v_out, bool v_transposed, double k_scale_inv,
                     double v_scale_inv) {
  translating_errors("pack_prefill_kv", [&] {
    const speedmla::TensorView nope = view(k_nope, "k_nope");
    speedmla::pack_prefill_kv(nope, view(k_rope, "k_rope"), view(v, "v"), view(k_out, "k_out"),
                              view(v_out, "v_out"),
                              value_layout(v_transposed),
                              static_cast<float>(k_scale_inv),
                              static_cast<float>(v_scale_inv), stream_of(nope.device));
  });
}

// max_kv_tokens and invariant_split_tokens 0: the four-argument form (mla_decode's workspace).
int64_t mla_decode_workspace_size(int64_t batch, int64_t num_heads, int64_t q_len, int64_t num_sms,
                                  int64_t max_kv_tokens, int64_t invariant_split_tokens) {
  return translating_errors("mla_decode_workspace_size", [&] {
    const int sms = static_cast<int>(num_sms);
    return static_cast<int64_t>(
        max_kv_tokens == 0 && invariant_split_tokens == 0
            ? speedmla::mla_decode_workspace_size(batch, num_heads, q_len, sms)
            : speedmla::mla_decode_workspace_size(batch, num_heads, q_len, sms, max_kv_tokens, invariant_split_tokens));
  });
}

// ---- reusable decode plans (speedmla/decode.h) -------------------------------------------------

// A DecodePlan for Python. It holds no memory: the Python DecodePlan keeps the workspace (and
// seq_lens) it was made with alive beside it.
class DecodePlanObj : public ffi::Object {
 public:
  explicit DecodePlanObj(const speedmla::DecodePlan& plan) : plan(plan) {}
  speedmla::DecodePlan plan;
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("speedmla.DecodePlan", DecodePlanObj, ffi::Object);
};

class DecodePlanRef : public ffi::ObjectRef {
 public:
  explicit DecodePlanRef(ffi::ObjectPtr<DecodePlanObj> ptr) : ffi::ObjectRef(std::move(ptr)) {}
  TVM_FFI_DEFINE_OBJECT_REF_METHODS_NOTNULLABLE(DecodePlanRef, ffi::ObjectRef, DecodePlanObj);
};

DecodePlanRef mla_decode_plan(ffi::TensorView seq_lens, ffi::TensorView block_table, int64_t num_heads,
                              int64_t q_len, ffi::String dtype, int64_t page_size,
                              ffi::Optional<ffi::TensorView> workspace, int64_t invariant_split_tokens) {
  return translating_errors("mla_decode_plan", [&] {
    DType type;
    if (dtype == "float8_e4m3fn") type = DType::kFloat8E4M3;
    else if (dtype == "bfloat16") type = DType::kBFloat16;
    else throw speedmla::Error("mla_decode_plan: dtype must be 'float8_e4m3fn' or 'bfloat16', got '" +
                               std::string(dtype) + "'");
    const speedmla::TensorView lens = view(seq_lens, "seq_lens");
    const speedmla::DecodePlan plan =
        speedmla::mla_decode_plan(lens, view(block_table, "block_table"), num_heads, q_len, type, page_size,
                                  view(workspace, "workspace"), invariant_split_tokens, stream_of(lens.device));
    return DecodePlanRef(ffi::make_object<DecodePlanObj>(plan));
  });
}

void mla_decode_with_plan(DecodePlanRef plan, ffi::TensorView q, ffi::TensorView kv_cache,
                          ffi::TensorView block_table, ffi::TensorView seq_lens, ffi::TensorView out,
                          ffi::Optional<ffi::TensorView> lse, double softmax_scale, double output_scale) {
  translating_errors("mla_decode_with_plan", [&] {
    const speedmla::TensorView q_view = view(q, "q");
    speedmla::mla_decode_with_plan(plan->plan, q_view, view(kv_cache, "kv_cache"), view(block_table, "block_table"),
                                   view(seq_lens, "seq_lens"), view(out, "out"), view(lse, "lse"),
                                   static_cast<float>(softmax_scale), static_cast<float>(output_scale),
                                   stream_of(q_view.device));
  });
}

int64_t device_sm_count(int64_t device) {
  return translating_errors("device_sm_count",
                            [&] { return int64_t{speedmla::device_sm_count(static_cast<int>(device))}; });
}

bool decode_page_size_supported(int64_t page_size) {
  return speedmla::decode_page_size_supported(page_size);
}

int64_t padded_block_table_width(int64_t context_len, int64_t page_size) {
  return translating_errors("padded_block_table_width",
                            [&] { return speedmla::padded_block_table_width(context_len, page_size); });
}

// The same memory with another dtype of the same width: how NumPy, which has no bfloat16 or
// float8 dtype, hands such data over (as uint16 / uint8 arrays) and reads results back.
ffi::Tensor view_as_dtype(ffi::Tensor source, ffi::String dtype) {
  const DLTensor* dl = source.GetDLTensorPtr();
  const DLDataType target = ffi::StringToDLDataType(dtype);
  if (target.bits != dl->dtype.bits || target.lanes != dl->dtype.lanes)
    throw ffi::Error("speedmla.Error",
                     "view_as_dtype: " + std::string(dtype) + " must have the element width of " +
                         std::string(ffi::DLDataTypeToString(dl->dtype)),
                     "");
  return ffi::Tensor::FromNDAllocStrided(
      BorrowedMemory{static_cast<char*>(dl->data) + dl->byte_offset,
                     std::make_shared<ffi::Tensor>(source)},
      source.shape(), source.strides(), target, dl->device);
}

// ---- the backend -------------------------------------------------------------------------------

class BackendObj : public ffi::Object {
 public:
  static constexpr bool _type_mutable = true;
  explicit BackendObj(const speedmla::MlaBackendConfig& config) : backend(config) {}
  speedmla::MlaBackend backend;
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("speedmla.MlaBackend", BackendObj, ffi::Object);
};

class Backend : public ffi::ObjectRef {
 public:
  explicit Backend(ffi::ObjectPtr<BackendObj> ptr) : ffi::ObjectRef(std::move(ptr)) {}
  TVM_FFI_DEFINE_OBJECT_REF_METHODS_NOTNULLABLE(Backend, ffi::ObjectRef, BackendObj);
  speedmla::MlaBackend& operator*() const { return get()->backend; }
  speedmla::Stream stream() const { return stream_of(get()->backend.config().device); }
};

speedmla::ForwardMode forward_mode(int64_t mode) {
  if (mode < 0 || mode > static_cast<int64_t>(speedmla::ForwardMode::kMixed))
    throw ffi::Error("speedmla.Error", "forward mode must be 0 (decode), 1 (extend) or 2 (mixed)", "");
  return static_cast<speedmla::ForwardMode>(mode);
}

Backend make_backend(int64_t num_heads, int64_t tp_size, int64_t page_size,
                     ffi::String kv_cache_dtype, int64_t context_len, int64_t max_batch,
                     int64_t max_graph_batch, int64_t num_draft_tokens, bool is_draft,
                     bool seed_compatible, int64_t chunked_prefill_capacity, bool cuda,
                     int64_t device) {
  return translating_errors("MlaBackend", [&] {
    speedmla::MlaBackendConfig config;
    config.num_heads = num_heads;
    config.tp_size = tp_size;
    config.page_size = page_size;
    const std::string dtype(kv_cache_dtype);
    if (dtype == "float8_e4m3fn") config.kv_cache_dtype = DType::kFloat8E4M3;
    else if (dtype == "bfloat16") config.kv_cache_dtype = DType::kBFloat16;
    else throw speedmla::Error("MlaBackend: kv_cache_dtype must be 'float8_e4m3fn' or 'bfloat16', got '" + dtype + "'");
    config.context_len = context_len;
    config.max_batch = max_batch;
    config.max_graph_batch = max_graph_batch;
    config.num_draft_tokens = num_draft_tokens;
    config.is_draft = is_draft;
    config.seed_compatible = seed_compatible;
    config.chunked_prefill_capacity = chunked_prefill_capacity;
    config.device = cuda ? speedmla::Device{speedmla::DeviceKind::kCUDA, static_cast<int>(device)}
                         : speedmla::Device{};
    return Backend(ffi::make_object<BackendObj>(config));
  });
}

int64_t backend_block_table_width(Backend b) { return (*b).block_table_width(); }

int64_t backend_workspace_bytes(Backend b, int64_t batch, int64_t q_len) {
  return translating_errors("MlaBackend::workspace_bytes",
                            [&] { return static_cast<int64_t>((*b).workspace_bytes(batch, q_len)); });
}

// Bytes of the backend's workspace for eager calls on the caller's current stream.
int64_t backend_workspace_capacity(Backend b) {
  return static_cast<int64_t>((*b).workspace_capacity(b.stream()));
}

void backend_init_forward_metadata(Backend b, int64_t bs, int64_t num_extends,
                                   ffi::TensorView req_pool_indices, ffi::TensorView seq_lens,
                                   int64_t mode, ffi::TensorView req_to_page,
                                   ffi::Optional<ffi::TensorView> prefix_lens,
                                   ffi::Optional<ffi::TensorView> extend_lens) {
  translating_errors("MlaBackend::init_forward_metadata", [&] {
    std::optional<speedmla::MlaBackend::ExtendLens> extend;
    if (prefix_lens.has_value() && extend_lens.has_value())
      extend = speedmla::MlaBackend::ExtendLens{view(*prefix_lens, "extend_prefix_lens_cpu"),
                                                view(*extend_lens, "extend_seq_lens_cpu")};
    (*b).init_forward_metadata(bs, num_extends, view(req_pool_indices, "req_pool_indices"),
                               view(seq_lens, "seq_lens"), forward_mode(mode),
                               view(req_to_page, "req_to_page"), extend, b.stream());
  });
}

// [num_extends, max_seq_len, block_table], or None without decode metadata. The block table
// keeps the backend's memory alive.
ffi::Optional<ffi::Array<ffi::Any>> backend_decode_metadata(Backend b) {
  const speedmla::DecodeMetadata* md = (*b).decode_metadata();
  if (md == nullptr) return std::nullopt;
  return ffi::Array<ffi::Any>{md->num_extends, md->max_seq_len, borrow(md->block_table, md->storage)};
}

// [num_extends, max_seq_len, max_extend_seq_len, cu_seq_lens, cu_extend_seq_lens, chunk_len,
//  max_loop_tokens, [chunk cu_seq_lens], [chunk slots], [max chunk len]], or None.
ffi::Optional<ffi::Array<ffi::Any>> backend_extend_metadata(Backend b) {
  const speedmla::ExtendMetadata* md = (*b).extend_metadata();
  if (md == nullptr) return std::nullopt;
  ffi::Array<ffi::Any> chunk_cu, chunk_slots, max_chunk_len;
  for (const speedmla::TensorView& t : md->chunk_cu_seq_lens) chunk_cu.push_back(borrow(t, md->storage));
  for (const speedmla::TensorView& t : md->chunk_slots) chunk_slots.push_back(borrow(t, md->storage));
  for (int32_t len : md->chunks.max_chunk_len) max_chunk_len.push_back(int64_t{len});
  return ffi::Array<ffi::Any>{md->num_extends,
                              md->max_seq_len,
                              md->max_extend_seq_len,
                              borrow(md->cu_seq_lens, md->storage),
                              borrow(md->cu_extend_seq_lens, md->storage),
                              md->chunks.chunk_len,
                              md->chunks.max_loop_tokens,
                              chunk_cu,
                              chunk_slots,
                              max_chunk_len};
}

int64_t backend_set_num_extends(Backend b, int64_t num_extends) {
  return translating_errors("MlaBackend::set_num_extends", [&] { return (*b).set_num_extends(num_extends); });
}

void backend_init_cuda_graph_state(Backend b, int64_t max_bs, ffi::TensorView seq_lens_buf) {
  translating_errors("MlaBackend::init_cuda_graph_state",
                     [&] { (*b).init_cuda_graph_state(max_bs, view(seq_lens_buf, "seq_lens_buf")); });
}

void backend_alias_cuda_graph_block_table(Backend b, Backend target) {
  translating_errors("MlaBackend::alias_cuda_graph_block_table", [&] { (*b).alias_cuda_graph_block_table(*target); });
}

void backend_capture_cuda_graph(Backend b, int64_t bs, int64_t mode) {
  translating_errors("MlaBackend::init_forward_metadata_capture_cuda_graph",
                     [&] { (*b).init_forward_metadata_capture_cuda_graph(bs, forward_mode(mode)); });
}

void backend_replay_cuda_graph(Backend b, int64_t bs, ffi::TensorView req_pool_indices,
                               ffi::Optional<ffi::TensorView> req_to_page, int64_t num_real,
                               int64_t mode) {
  translating_errors("MlaBackend::init_forward_metadata_replay_cuda_graph", [&] {
    (*b).init_forward_metadata_replay_cuda_graph(bs, view(req_pool_indices, "req_pool_indices"),
                                                 view(req_to_page, "req_to_page"), num_real,
                                                 forward_mode(mode), b.stream());
  });
}

void backend_forward_decode(Backend b, ffi::TensorView q, ffi::TensorView kv_cache, int64_t bs,
                            ffi::TensorView out, double scaling, double k_scale,
                            ffi::Optional<ffi::TensorView> new_kv,
                            ffi::Optional<ffi::TensorView> new_kv_slots,
                            ffi::Optional<ffi::TensorView> lse) {
  translating_errors("MlaBackend::forward_decode", [&] {
    std::optional<speedmla::NewTokenKv> write;
    if (new_kv.has_value() != new_kv_slots.has_value())
      throw speedmla::Error("MlaBackend::forward_decode: k and out_cache_loc go together");
    if (new_kv.has_value()) write = speedmla::NewTokenKv{view(*new_kv, "k"), view(*new_kv_slots, "out_cache_loc")};
    (*b).forward_decode(view(q, "q"), view(kv_cache, "kv_cache"), bs, view(out, "out"),
                        static_cast<float>(scaling), static_cast<float>(k_scale), write,
                        view(lse, "lse"), b.stream());
  });
}

void backend_forward_extend_chunked(Backend b, ffi::TensorView q, ffi::TensorView k,
                                    ffi::TensorView v, bool v_transposed, ffi::TensorView cu_seqlens_q,
                                    ffi::TensorView cu_seqlens_k, bool causal, double softmax_scale,
                                    ffi::TensorView out, ffi::TensorView lse) {
  translating_errors("MlaBackend::forward_extend_chunked", [&] {
    (*b).forward_extend_chunked(view(q, "q"), view(k, "k"), view(v, "v"),
                                value_layout(v_transposed),
                                view(cu_seqlens_q, "cum_seq_lens_q"),
                                view(cu_seqlens_k, "cum_seq_lens_kv"), causal,
                                static_cast<float>(softmax_scale), view(out, "out"),
                                view(lse, "lse"), b.stream());
  });
}

// `expand(latent, k, v)` is a Python callable; it receives tvm_ffi tensors valid for the call.
void backend_attend_cached_prefix(Backend b, ffi::TensorView q, ffi::TensorView kv_cache,
                                  double k_scale, ffi::Function expand,
                                  ffi::TensorView scratch_latent, ffi::TensorView scratch_k,
                                  ffi::TensorView scratch_v, bool v_transposed, ffi::TensorView scratch_out,
                                  ffi::TensorView scratch_lse, ffi::TensorView out,
                                  ffi::TensorView lse, double softmax_scale) {
  translating_errors("MlaBackend::attend_cached_prefix", [&] {
    const speedmla::PrefixExpander expander = [&](const speedmla::TensorView& latent,
                                                  const speedmla::TensorView& k,
                                                  const speedmla::TensorView& v) {
      expand(borrow(latent, nullptr), borrow(k, nullptr), borrow(v, nullptr));
    };
    const speedmla::PrefixScratch scratch{view(scratch_latent, "scratch latent"),
                                          view(scratch_k, "scratch k"), view(scratch_v, "scratch v"),
                                          view(scratch_out, "scratch out"),
                                          view(scratch_lse, "scratch lse"),
                                          value_layout(v_transposed)};
    (*b).attend_cached_prefix(view(q, "q"), view(kv_cache, "kv_cache"), static_cast<float>(k_scale),
                              expander, scratch, view(out, "out"), view(lse, "lse"),
                              static_cast<float>(softmax_scale), b.stream());
  });
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(mla_decode, mla_decode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(mla_prefill, mla_prefill);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_attn_states, merge_attn_states);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(kv_cache_write, kv_cache_write);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gather_cache, gather_cache);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(quantize_fp8, quantize_fp8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pack_prefill_kv, pack_prefill_kv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(mla_decode_workspace_size, mla_decode_workspace_size);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(mla_decode_plan, mla_decode_plan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(mla_decode_with_plan, mla_decode_with_plan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(device_sm_count, device_sm_count);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode_page_size_supported, decode_page_size_supported);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(padded_block_table_width, padded_block_table_width);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(view_as_dtype, view_as_dtype);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(make_backend, make_backend);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_block_table_width, backend_block_table_width);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_workspace_bytes, backend_workspace_bytes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_workspace_capacity, backend_workspace_capacity);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_init_forward_metadata, backend_init_forward_metadata);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_decode_metadata, backend_decode_metadata);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_extend_metadata, backend_extend_metadata);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_set_num_extends, backend_set_num_extends);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_init_cuda_graph_state, backend_init_cuda_graph_state);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_alias_cuda_graph_block_table, backend_alias_cuda_graph_block_table);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_capture_cuda_graph, backend_capture_cuda_graph);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_replay_cuda_graph, backend_replay_cuda_graph);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_forward_decode, backend_forward_decode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_forward_extend_chunked, backend_forward_extend_chunked);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backend_attend_cached_prefix, backend_attend_cached_prefix);
