#include "common/fuzz.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "common/op_testing.h"
#include "speedmla/speedmla.h"

namespace speedmla::test::fuzz {
namespace {

constexpr DType kAllDTypes[] = {DType::kFloat8E4M3, DType::kBFloat16, DType::kFloat16, DType::kFloat32,
                                DType::kInt32,      DType::kInt64,    DType::kUInt8};
constexpr DType kFloatInputs[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
constexpr int64_t kGpuMargin = 256;  // poisoned bytes on either side of each device storage
constexpr uint8_t kOutputPoison = 0xFF;  // NaN in every float dtype
constexpr uint8_t kMarginPoison = 0xA5;

int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // inclusive
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}
bool chance(std::mt19937_64& rng, double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }
template <typename T, size_t N>
T pick(std::mt19937_64& rng, const T (&items)[N]) { return items[uniform(rng, 0, N - 1)]; }

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = s;
    s *= std::max<int64_t>(shape[d], 1);
  }
  return strides;
}

bool is_float(DType d) { return d != DType::kInt32 && d != DType::kInt64 && d != DType::kUInt8; }

// Elements the view addresses, or -1 when an extent is negative (nothing may be read then).
int64_t numel_of(const Arg& a) {
  int64_t n = 1;
  for (int64_t s : a.shape) {
    if (s < 0) return -1;
    n *= s;
  }
  return n;
}

// Lowest and highest element offsets of the view (numel > 0).
std::pair<int64_t, int64_t> span_of(const Arg& a) {
  int64_t lo = 0, hi = 0;
  for (size_t d = 0; d < a.shape.size(); ++d) {
    const int64_t span = (a.shape[d] - 1) * a.strides[d];
    (span < 0 ? lo : hi) += span;
  }
  return {lo, hi};
}

// Bytes of storage the view needs (with its misalignment); 0 for an empty view.
int64_t storage_bytes(const Arg& a) {
  if (numel_of(a) <= 0) return 0;
  const auto [lo, hi] = span_of(a);
  return (hi - lo + 1) * static_cast<int64_t>(dtype_size(a.dtype)) + a.misalign_bytes;
}

Arg make_arg(std::string name, Role role, DType dtype, std::vector<int64_t> shape) {
  Arg a;
  a.name = std::move(name);
  a.role = role;
  a.dtype = dtype;
  a.strides = contiguous_strides(shape);
  a.shape = std::move(shape);
  return a;
}

int find_arg(const Case& c, const std::string& name) {
  for (size_t i = 0; i < c.args.size(); ++i)
    if (c.args[i].name == name) return static_cast<int>(i);
  throw std::logic_error("fuzz: no argument " + name);
}
int64_t dim_or(const Case& c, const std::string& name, size_t d, int64_t fallback) {
  const Arg& a = c.args[find_arg(c, name)];
  return d < a.shape.size() ? std::max<int64_t>(a.shape[d], 0) : fallback;
}

// ---- the valid base cases -------------------------------------------------------------------

DType attention_dtype(std::mt19937_64& rng) { return chance(rng, 0.5) ? DType::kFloat8E4M3 : DType::kBFloat16; }

Case base_decode(std::mt19937_64& rng, Target target) {
  const DType dtype = attention_dtype(rng);
  const int64_t batch = uniform(rng, 0, 3), q_len = uniform(rng, 1, 3), heads = uniform(rng, 1, 4);
  constexpr int64_t kGpuPageSizes[] = {1, 2, 4, 8, 16, 32, 64, 128};
  const int64_t page_size = target == Target::kGpu && chance(rng, 0.9) ? pick(rng, kGpuPageSizes) : uniform(rng, 1, 16);
  const int64_t num_pages = uniform(rng, 1, 6), max_pages = uniform(rng, 0, 4);
  Case c;
  c.op = Op::kDecode;
  c.args = {make_arg("q", Role::kInput, dtype, {batch, q_len, heads, kCacheRowDim}),
            make_arg("kv_cache", Role::kInput, dtype, {num_pages, page_size, kCacheRowDim}),
            make_arg("block_table", Role::kInput, DType::kInt32, {batch, max_pages}),
            make_arg("seq_lens", Role::kInput, DType::kInt32, {batch}),
            make_arg("out", Role::kOutput, DType::kBFloat16, {batch, q_len, heads, kLatentDim}),
            make_arg("lse", Role::kOutput, DType::kFloat32, {batch, q_len, heads}),
            make_arg("workspace", Role::kOutput, DType::kUInt8, {0})};
  c.args[5].present = chance(rng, 0.8);
  c.args[6].present = target == Target::kGpu;  // the CPU takes none
  c.scale_a = 0.0417f;
  c.scale_b = chance(rng, 0.8) ? 1.f : 0.5f;
  return c;
}

Case base_prefill(std::mt19937_64& rng, Target) {
  const DType dtype = attention_dtype(rng);
  const int64_t batch = uniform(rng, 0, 3), kv_heads = uniform(rng, 1, 2), heads = kv_heads * uniform(rng, 1, 2);
  int64_t total_q = 0, total_k = 0;
  for (int64_t b = 0; b < batch; ++b) {
    total_q += uniform(rng, 0, 70);  // past one 64-row tile now and then
    total_k += uniform(rng, 0, 80);
  }
  total_q += uniform(rng, 0, 2);  // rows past cu_seqlens[B] are legal and stay untouched
  total_k += uniform(rng, 0, 2);
  Case c;
  c.op = Op::kPrefill;
  // FP8 values in the transposed layout now and then: [H_kv, 128, T], T the keys rounded up to 16
  // (sometimes a group more).
  if (dtype == DType::kFloat8E4M3 && chance(rng, 0.4)) c.v_layout = PrefillValueLayout::kFp8Transposed;
  const std::vector<int64_t> v_shape =
      c.v_layout == PrefillValueLayout::kFp8Transposed
          ? std::vector<int64_t>{kv_heads, kPrefillVDim, fp8_transposed_value_positions(total_k) + 16 * uniform(rng, 0, 1)}
          : std::vector<int64_t>{total_k, kv_heads, kPrefillVDim};
  c.args = {make_arg("q", Role::kInput, dtype, {total_q, heads, kPrefillQkDim}),
            make_arg("k", Role::kInput, dtype, {total_k, kv_heads, kPrefillQkDim}),
            make_arg("v", Role::kInput, dtype, v_shape),
            make_arg("cu_seqlens_q", Role::kInput, DType::kInt32, {batch + 1}),
            make_arg("cu_seqlens_k", Role::kInput, DType::kInt32, {batch + 1}),
            make_arg("out", Role::kOutput, DType::kBFloat16, {total_q, heads, kPrefillVDim}),
            make_arg("lse", Role::kOutput, DType::kFloat32, {total_q, heads})};
  c.args[6].present = chance(rng, 0.8);
  c.causal = chance(rng, 0.5);
  c.scale_a = 0.0722f;
  c.scale_b = 1.f;
  return c;
}

Case base_merge(std::mt19937_64& rng, Target) {
  const int64_t tokens = uniform(rng, 0, 4), heads = uniform(rng, 1, 3);
  constexpr int64_t kDims[] = {1, 7, 8, 64, 128, 512};
  const int64_t dim = pick(rng, kDims);
  constexpr DType kOut[] = {DType::kBFloat16, DType::kFloat32};
  Case c;
  c.op = Op::kMerge;
  c.args = {make_arg("out_a", Role::kInput, pick(rng, kOut), {tokens, heads, dim}),
            make_arg("lse_a", Role::kInput, DType::kFloat32, {tokens, heads}),
            make_arg("out_b", Role::kInput, pick(rng, kOut), {tokens, heads, dim}),
            make_arg("lse_b", Role::kInput, DType::kFloat32, {tokens, heads}),
            make_arg("out", Role::kOutput, pick(rng, kOut), {tokens, heads, dim}),
            make_arg("lse", Role::kOutput, DType::kFloat32, {tokens, heads})};
  c.args[5].present = chance(rng, 0.8);
  if (chance(rng, 0.3)) {  // in place into a
    c.args[4].dtype = c.args[0].dtype;
    c.args[4].alias_of = 0;
    c.args[5].alias_of = 1;
  }
  return c;
}

Case base_cache(Op op, std::mt19937_64& rng, Target) {
  const DType dtype = attention_dtype(rng);
  const int64_t num_pages = uniform(rng, 1, 4), page_size = uniform(rng, 1, 8), tokens = uniform(rng, 0, 5);
  Case c;
  c.op = op;
  c.args = {make_arg("kv_cache", op == Op::kCacheWrite ? Role::kInOut : Role::kInput, dtype,
                     {num_pages, page_size, kCacheRowDim}),
            make_arg("slots", Role::kInput, DType::kInt64, {tokens})};
  if (op == Op::kCacheWrite) {
    c.args.push_back(make_arg("latent", Role::kInput, pick(rng, kFloatInputs), {tokens, kLatentDim}));
    c.args.push_back(make_arg("rope", Role::kInput, pick(rng, kFloatInputs), {tokens, kRopeDim}));
  } else {
    c.args.push_back(make_arg("out", Role::kOutput, DType::kBFloat16, {tokens, kCacheRowDim}));
  }
  c.scale_a = chance(rng, 0.7) ? 1.f : 0.25f;
  return c;
}

Case base_quantize(std::mt19937_64& rng, Target) {
  std::vector<int64_t> shape(uniform(rng, 1, 4));
  for (int64_t& s : shape) s = uniform(rng, 0, 5);
  shape.back() = uniform(rng, 1, 40);
  Case c;
  c.op = Op::kQuantize;
  c.args = {make_arg("x", Role::kInput, pick(rng, kFloatInputs), shape),
            make_arg("out", Role::kOutput, DType::kFloat8E4M3, shape)};
  c.scale_a = chance(rng, 0.7) ? 1.f : 8.f;
  return c;
}

Case base_pack(std::mt19937_64& rng, Target) {
  const int64_t tokens = uniform(rng, 0, 4), heads = uniform(rng, 1, 3);
  const DType in = pick(rng, kFloatInputs), out = attention_dtype(rng);
  std::vector<int64_t> rope_shape = {tokens, kRopeDim};
  if (chance(rng, 0.3)) rope_shape = {tokens, 1, kRopeDim};
  Case c;
  c.op = Op::kPack;
  if (out == DType::kFloat8E4M3 && chance(rng, 0.4)) c.v_layout = PrefillValueLayout::kFp8Transposed;
  const std::vector<int64_t> v_out_shape =
      c.v_layout == PrefillValueLayout::kFp8Transposed
          ? std::vector<int64_t>{heads, kPrefillVDim, fp8_transposed_value_positions(tokens) + 16 * uniform(rng, 0, 1)}
          : std::vector<int64_t>{tokens, heads, kPrefillVDim};
  c.args = {make_arg("k_nope", Role::kInput, in, {tokens, heads, 128}),
            make_arg("k_rope", Role::kInput, in, rope_shape),
            make_arg("v", Role::kInput, in, {tokens, heads, 128}),
            make_arg("k_out", Role::kOutput, out, {tokens, heads, kPrefillQkDim}),
            make_arg("v_out", Role::kOutput, out, v_out_shape)};
  c.scale_a = 1.f;
  c.scale_b = chance(rng, 0.7) ? 1.f : 0.5f;
  return c;
}

// ---- mutations ------------------------------------------------------------------------------

// How many of scale_a, scale_b the operation takes.
int scales_of(Op op) {
  switch (op) {
    case Op::kMerge: return 0;
    case Op::kCacheWrite:
    case Op::kGatherCache:
    case Op::kQuantize: return 1;
    default: return 2;
  }
}

// Value faults, applied after the valid contents are drawn.
enum class ValueFault { kNone, kLength, kPageId, kCuSeqlens, kSlot, kNonFinite };

struct Plan {
  std::vector<ValueFault> faults;
};

// One structural mutation of a random argument (or a scale). Returns its description.
std::string mutate(Case& c, std::mt19937_64& rng, Target target, Plan& plan) {
  const int index = static_cast<int>(uniform(rng, 0, c.args.size() - 1));
  Arg& a = c.args[index];
  const std::string who = a.name;
  switch (uniform(rng, 0, 11)) {
    case 0: {
      a.dtype = pick(rng, kAllDTypes);
      return who + ".dtype=" + dtype_name(a.dtype);
    }
    case 1: {
      if (a.shape.size() < 5 && chance(rng, 0.5)) {
        a.shape.push_back(1);
        a.strides.push_back(1);
        return who + " one more dim";
      }
      if (a.shape.empty()) return "none";
      a.shape.pop_back();
      a.strides.pop_back();
      return who + " one dim less";
    }
    case 2: {
      if (a.shape.empty()) return "none";
      const size_t d = uniform(rng, 0, a.shape.size() - 1);
      constexpr int64_t kDeltas[] = {1, -1, 2};
      if (chance(rng, 0.2)) a.shape[d] = -1;
      else if (chance(rng, 0.2)) a.shape[d] = 0;
      else a.shape[d] = std::max<int64_t>(0, a.shape[d] + pick(rng, kDeltas));
      a.strides = contiguous_strides(a.shape);
      return who + ".shape[" + std::to_string(d) + "]=" + std::to_string(a.shape[d]);
    }
    case 3: {  // strides: padded rows, broadcast, reversed, or a gap in the last dim
      if (a.shape.empty()) return "none";
      const size_t d = uniform(rng, 0, a.shape.size() - 1);
      switch (uniform(rng, 0, 3)) {
        case 0: {
          // A wider row at dim d (the dims above it follow, so the view stays non-overlapping);
          // at the last dim that is a gap between elements.
          const int64_t pad = uniform(rng, 1, 64) * (chance(rng, 0.5) ? 1 : 16);
          a.strides[d] += pad;
          for (size_t e = d; e-- > 0;) a.strides[e] = a.strides[e + 1] * std::max<int64_t>(a.shape[e + 1], 1);
          return who + ".stride(" + std::to_string(d) + ")+=" + std::to_string(pad);
        }
        case 1: a.strides[d] = 0; return who + ".stride(" + std::to_string(d) + ")=0";
        case 2: a.strides[d] = -a.strides[d]; return who + ".stride(" + std::to_string(d) + ") negated";
        default:
          a.strides.back() = 2;
          for (size_t e = 0; e + 1 < a.strides.size(); ++e) a.strides[e] *= 2;
          return who + " last-dim stride 2";
      }
    }
    case 4: a.on_other_device = true; return who + (target == Target::kCpu ? " on cuda:0" : " on the cpu");
    case 5: a.null_data = true; return who + " null data";
    case 6: {
      constexpr int64_t kMisalign[] = {1, 2, 4, 8, 16};
      a.misalign_bytes = pick(rng, kMisalign);
      return who + " data +" + std::to_string(a.misalign_bytes) + " bytes";
    }
    case 7: {  // an output placed inside an input's storage
      if (a.role == Role::kInput) return "none";
      const int other = static_cast<int>(uniform(rng, 0, c.args.size() - 1));
      if (other == index || c.args[other].role != Role::kInput) return "none";
      // merge's out and lse may be out_a and lse_a exactly (in place): not an overlap.
      if (c.op == Op::kMerge && (a.name == "out" || a.name == "lse") && c.args[other].name == a.name + "_a")
        return "none";
      a.inside_of = other;
      a.alias_of = -1;
      return who + " inside " + c.args[other].name;
    }
    case 8: {
      if (scales_of(c.op) == 0) return "none";
      constexpr float kScales[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                   -std::numeric_limits<float>::infinity(), 0.f, -1.f, 1e30f};
      float& s = scales_of(c.op) == 2 && chance(rng, 0.5) ? c.scale_b : c.scale_a;
      s = pick(rng, kScales);
      return "a scale=" + std::to_string(s);
    }
    case 9: {  // an optional argument left out, or given where the call takes none
      if (a.name != "lse" && a.name != "workspace") return "none";
      a.present = !a.present;
      return who + (a.present ? " given" : " left out");
    }
    case 10: {
      constexpr ValueFault kIndexFaults[] = {ValueFault::kLength, ValueFault::kPageId, ValueFault::kCuSeqlens,
                                             ValueFault::kSlot};
      plan.faults.push_back(pick(rng, kIndexFaults));
      return "bad index values";
    }
    default: plan.faults.push_back(ValueFault::kNonFinite); return "NaN/inf in an input";
  }
}

// ---- contents ---------------------------------------------------------------------------------

void set_index(HostTensor& t, int64_t i, int64_t value) {
  if (t.view().dtype == DType::kInt64) t.data<int64_t>()[i] = value;
  else if (t.view().dtype == DType::kInt32) t.data<int32_t>()[i] = static_cast<int32_t>(value);
  else set(t, i, static_cast<double>(value));
}

// `count` non-decreasing offsets from 0, the last <= total.
void fill_cu_seqlens(HostTensor& t, int64_t total, std::mt19937_64& rng) {
  const int64_t n = t.numel();
  if (n == 0) return;
  std::vector<int64_t> cuts(n);
  const int64_t end = total - (total > 0 && chance(rng, 0.3) ? uniform(rng, 0, std::min<int64_t>(total, 2)) : 0);
  for (int64_t& v : cuts) v = uniform(rng, 0, std::max<int64_t>(end, 0));
  std::sort(cuts.begin(), cuts.end());
  cuts[0] = 0;
  if (n > 1) cuts[n - 1] = end;
  for (int64_t i = 0; i < n; ++i) set_index(t, i, cuts[i]);
}

// The valid contents of every argument for the (possibly mutated) shapes.
void fill_contents(Case& c, std::mt19937_64& rng) {
  for (Arg& a : c.args) {
    if (a.alias_of >= 0) continue;
    // A negative extent holds nothing (an empty tensor, not a default one, which has 1 element).
    a.values = HostTensor(a.dtype, numel_of(a) < 0 ? std::vector<int64_t>{0} : a.shape);
    if (a.role == Role::kOutput) fill_bytes(a.values, kOutputPoison);
    else if (is_float(a.dtype)) fill_uniform(a.values, rng, -1.0, 1.0);
    else fill_bytes(a.values, 0);
  }
  auto values = [&](const char* name) -> HostTensor& { return c.args[find_arg(c, name)].values; };
  switch (c.op) {
    case Op::kDecode: {
      const int64_t num_pages = dim_or(c, "kv_cache", 0, 1), page_size = dim_or(c, "kv_cache", 1, 1);
      const int64_t max_pages = dim_or(c, "block_table", 1, 0);
      HostTensor& table = values("block_table");
      for (int64_t i = 0; i < table.numel(); ++i)
        set_index(table, i, uniform(rng, 0, std::max<int64_t>(num_pages - 1, 0)));
      HostTensor& lens = values("seq_lens");
      for (int64_t i = 0; i < lens.numel(); ++i) set_index(lens, i, uniform(rng, 0, max_pages * page_size));
      break;
    }
    case Op::kPrefill:
      fill_cu_seqlens(values("cu_seqlens_q"), dim_or(c, "q", 0, 0), rng);
      fill_cu_seqlens(values("cu_seqlens_k"), dim_or(c, "k", 0, 0), rng);
      break;
    case Op::kMerge:
      for (const char* name : {"lse_a", "lse_b"}) {
        HostTensor& lse = values(name);
        if (!is_float(lse.view().dtype)) continue;
        for (int64_t i = 0; i < lse.numel(); ++i) set(lse, i, std::uniform_real_distribution<double>(-20, 20)(rng));
      }
      break;
    case Op::kCacheWrite:
    case Op::kGatherCache: {
      const int64_t num_slots = dim_or(c, "kv_cache", 0, 1) * dim_or(c, "kv_cache", 1, 1);
      HostTensor& slots = values("slots");
      std::vector<int64_t> order(static_cast<size_t>(std::max<int64_t>(num_slots, 0)));
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
      std::shuffle(order.begin(), order.end(), rng);
      // Distinct slots (a write of two rows to one slot keeps either on the GPU), some padding.
      for (int64_t i = 0; i < slots.numel(); ++i)
        set_index(slots, i, chance(rng, 0.15) || i >= num_slots ? -1 : order[i]);
      break;
    }
    case Op::kQuantize:
    case Op::kPack: break;
  }
}

void apply_fault(Case& c, ValueFault fault, std::mt19937_64& rng, Target target) {
  constexpr int64_t kInt32Min = std::numeric_limits<int32_t>::min(), kInt32Max = std::numeric_limits<int32_t>::max();
  auto pick_element = [&](const char* name) -> std::pair<HostTensor*, int64_t> {
    for (Arg& a : c.args)
      if (a.name == name && a.alias_of < 0 && a.values.numel() > 0)
        return {&a.values, uniform(rng, 0, a.values.numel() - 1)};
    return {nullptr, 0};
  };
  switch (fault) {
    case ValueFault::kNone: return;
    case ValueFault::kLength: {
      if (c.op != Op::kDecode) return;
      auto [t, i] = pick_element("seq_lens");
      if (!t) return;
      const int64_t max_tokens = dim_or(c, "block_table", 1, 0) * dim_or(c, "kv_cache", 1, 1);
      const int64_t q_len = dim_or(c, "q", 1, 1);
      const int64_t bad[] = {-1, kInt32Min, kInt32Max, max_tokens + 1, q_len - 1, 0};
      set_index(*t, i, pick(rng, bad));
      return;
    }
    case ValueFault::kPageId: {
      if (c.op != Op::kDecode) return;
      auto [t, i] = pick_element("block_table");
      if (!t) return;
      const int64_t bad[] = {-1, dim_or(c, "kv_cache", 0, 1), kInt32Max, kInt32Min};
      set_index(*t, i, pick(rng, bad));
      return;
    }
    case ValueFault::kCuSeqlens: {
      if (c.op != Op::kPrefill) return;
      auto [t, i] = pick_element(chance(rng, 0.5) ? "cu_seqlens_q" : "cu_seqlens_k");
      if (!t) return;
      // Near INT_MIN the GPU prefill kernel's tile search overflows (docs/device-values.md,
      // "Known gap"; its own test is PrefillCuSeqlensOverflow): the GPU fuzz keeps clear of it.
      const int64_t bad[] = {-1, 1, kInt32Max, target == Target::kGpu ? -4096 : kInt32Min,
                             static_cast<int64_t>(get(*t, i)) + 70};
      set_index(*t, i, pick(rng, bad));
      c.values_out_of_contract = true;
      return;
    }
    case ValueFault::kSlot: {
      if (c.op != Op::kCacheWrite && c.op != Op::kGatherCache) return;
      auto [t, i] = pick_element("slots");
      if (!t) return;
      const int64_t num_slots = dim_or(c, "kv_cache", 0, 1) * dim_or(c, "kv_cache", 1, 1);
      const int64_t bad[] = {num_slots, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(), -7,
                             int64_t{1} << 40};
      set_index(*t, i, pick(rng, bad));
      return;
    }
    case ValueFault::kNonFinite: {
      std::vector<Arg*> inputs;
      for (Arg& a : c.args)
        if (a.role != Role::kOutput && a.alias_of < 0 && is_float(a.dtype) && a.values.numel() > 0)
          inputs.push_back(&a);
      if (inputs.empty()) return;
      Arg& a = *inputs[uniform(rng, 0, inputs.size() - 1)];
      constexpr double kSpecial[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                                     -std::numeric_limits<double>::infinity()};
      for (int64_t n = uniform(rng, 1, 3); n > 0; --n)
        set(a.values, uniform(rng, 0, a.values.numel() - 1), pick(rng, kSpecial));
      // The contract gives NaN/inf inside attention no meaning beyond "not out of bounds".
      if (c.op == Op::kDecode || c.op == Op::kPrefill) c.values_out_of_contract = true;
      return;
    }
  }
}

// Whether the case breaks a rule every entry point enforces, so that it must be refused.
bool clearly_invalid(const Case& c) {
  if (scales_of(c.op) >= 1 && !std::isfinite(c.scale_a)) return true;
  if (scales_of(c.op) == 2 && !std::isfinite(c.scale_b)) return true;
  for (const Arg& a : c.args) {
    if (!a.present) continue;
    if (a.on_other_device) return true;
    const int64_t n = numel_of(a);
    if (n < 0) return true;
    if (n > 0 && a.null_data) return true;
    if (n > 0 && a.misalign_bytes % static_cast<int64_t>(dtype_size(a.dtype)) != 0) return true;
    if (a.inside_of >= 0 && n > 0 && storage_bytes(a) <= storage_bytes(c.args[a.inside_of])) return true;
  }
  return false;
}

// ---- materialised storage -------------------------------------------------------------------

// Host memory whose usable bytes end at an inaccessible page and start after one.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t bytes) {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t rounded = (bytes + 15) / 16 * 16;
    body_ = (rounded + page_ - 1) / page_ * page_;
    total_ = body_ + 2 * page_;
    void* base = mmap(nullptr, total_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::runtime_error("fuzz: mmap failed");
    base_ = static_cast<uint8_t*>(base);
    if (body_ && mprotect(base_ + page_, body_, PROT_READ | PROT_WRITE) != 0)
      throw std::runtime_error("fuzz: mprotect failed");
    data_ = base_ + page_ + body_ - rounded;  // 16-byte aligned, flush with the trailing guard
  }
  ~GuardedBuffer() { munmap(base_, total_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  uint8_t* data() const { return data_; }
  void* guard() const { return base_; }  // any access faults

 private:
  size_t page_ = 0, body_ = 0, total_ = 0;
  uint8_t* base_ = nullptr;
  uint8_t* data_ = nullptr;
};

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string("fuzz: ") + what + ": " + cudaGetErrorString(status));
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { cuda_ok(cudaMalloc(&ptr, bytes), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// One argument in memory: host storage (guarded), on the GPU a device copy with margins.
struct Storage {
  int64_t bytes = 0;        // the view's storage (misalignment included)
  int64_t data_offset = 0;  // bytes from the storage's start to the view's data
  std::unique_ptr<GuardedBuffer> host;
  std::unique_ptr<DeviceBuffer> device;  // [margin][storage][margin]
  std::vector<uint8_t> before;           // the storage (and margins on the GPU) before the call
  TensorView view;
};

// Byte offset in the storage of every element of the view, row-major.
std::vector<int64_t> element_offsets(const Arg& a, int64_t data_offset) {
  const int64_t n = numel_of(a);
  std::vector<int64_t> offsets;
  if (n <= 0) return offsets;
  offsets.reserve(n);
  const int64_t esize = static_cast<int64_t>(dtype_size(a.dtype));
  std::vector<int64_t> index(a.shape.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t e = 0;
    for (size_t d = 0; d < a.shape.size(); ++d) e += index[d] * a.strides[d];
    offsets.push_back(data_offset + e * esize);
    for (size_t d = a.shape.size(); d-- > 0;) {
      if (++index[d] < a.shape[d]) break;
      index[d] = 0;
    }
  }
  return offsets;
}

TensorView view_of(const Arg& a, void* data, Device device) {
  TensorView v;
  v.data = a.null_data ? nullptr : data;
  v.dtype = a.dtype;
  v.device = device;
  v.ndim = static_cast<int>(a.shape.size());
  for (size_t d = 0; d < a.shape.size(); ++d) {
    v.shape[d] = a.shape[d];
    v.strides[d] = a.strides[d];
  }
  return v;
}

const Device kGpu0{DeviceKind::kCUDA, 0};

// Lays out every argument; aliases share their target's storage and view, and an output placed
// inside an input (when it fits) shares that input's storage.
std::vector<Storage> materialise(const Case& c, Target target) {
  std::vector<Storage> st(c.args.size());
  const Device home = target == Target::kGpu ? kGpu0 : Device{};
  const Device other = target == Target::kGpu ? Device{} : kGpu0;
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    if (a.alias_of >= 0) continue;
    Storage& s = st[i];
    const int64_t esize = static_cast<int64_t>(dtype_size(a.dtype));
    if (numel_of(a) > 0) {
      s.bytes = storage_bytes(a);
      s.data_offset = a.misalign_bytes - span_of(a).first * esize;
    }
    if (a.inside_of >= 0 && s.bytes > 0 && s.bytes <= storage_bytes(c.args[a.inside_of])) continue;  // carved
    s.host = std::make_unique<GuardedBuffer>(static_cast<size_t>(s.bytes));
    std::memset(s.host->data(), kOutputPoison, s.bytes);
    const std::vector<int64_t> offsets = element_offsets(a, s.data_offset);
    for (size_t e = 0; e < offsets.size(); ++e)
      std::memcpy(s.host->data() + offsets[e], static_cast<const uint8_t*>(a.values.view().data) + e * esize, esize);
    if (target == Target::kGpu) {
      s.device = std::make_unique<DeviceBuffer>(static_cast<size_t>(s.bytes + 2 * kGpuMargin));
      std::vector<uint8_t> image(s.bytes + 2 * kGpuMargin, kMarginPoison);
      std::memcpy(image.data() + kGpuMargin, s.host->data(), s.bytes);
      cuda_ok(cudaMemcpy(s.device->ptr, image.data(), image.size(), cudaMemcpyHostToDevice), "upload");
    }
  }
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    if (a.alias_of >= 0) continue;
    Storage& s = st[i];
    const Storage& owner = s.host ? s : st[a.inside_of];
    void* data;
    if (a.on_other_device)
      data = owner.host->guard();  // on the wrong device: must never be dereferenced
    else if (target == Target::kGpu)
      data = static_cast<uint8_t*>(owner.device->ptr) + kGpuMargin + s.data_offset;
    else
      data = s.bytes > 0 ? owner.host->data() + s.data_offset : owner.host->guard();  // empty: faults if read
    s.view = view_of(a, data, a.on_other_device ? other : home);
  }
  for (size_t i = 0; i < c.args.size(); ++i)
    if (c.args[i].alias_of >= 0) st[i].view = st[c.args[i].alias_of].view;
  return st;
}

// The storage bytes (and, on the GPU, margins) as they are now.
std::vector<uint8_t> snapshot(const Storage& s, Target target) {
  if (!s.host) return {};
  if (target == Target::kGpu) {
    std::vector<uint8_t> image(s.bytes + 2 * kGpuMargin);
    cuda_ok(cudaMemcpy(image.data(), s.device->ptr, image.size(), cudaMemcpyDeviceToHost), "download");
    return image;
  }
  return std::vector<uint8_t>(s.host->data(), s.host->data() + s.bytes);
}

// ---- calls ----------------------------------------------------------------------------------

using Views = std::vector<std::optional<TensorView>>;

void call(const Case& c, const Views& v) {
  switch (c.op) {
    case Op::kDecode:
      mla_decode(*v[0], *v[1], *v[2], *v[3], *v[4], v[5], v[6], c.scale_a, c.scale_b);
      return;
    case Op::kPrefill:
      mla_prefill(*v[0], *v[1], *v[2], c.v_layout, *v[3], *v[4], *v[5], v[6], c.causal, c.scale_a, c.scale_b);
      return;
    case Op::kMerge: merge_attn_states(*v[0], *v[1], *v[2], *v[3], *v[4], v[5]); return;
    case Op::kCacheWrite: kv_cache_write(*v[0], *v[1], *v[2], *v[3], c.scale_a); return;
    case Op::kGatherCache: gather_cache(*v[0], *v[1], *v[2], c.scale_a); return;
    case Op::kQuantize: quantize_fp8(*v[0], *v[1], c.scale_a); return;
    case Op::kPack:
      pack_prefill_kv(*v[0], *v[1], *v[2], *v[3], *v[4], c.v_layout, c.scale_a, c.scale_b);
      return;
  }
}

// The identifier a message starts with after "<function>: " must be an argument of the call (or
// a scalar one): the caller can tell what to fix.
std::string names_argument(const Case& c, const std::string& message) {
  const std::string prefix = std::string(op_name(c.op)) + ": ";
  if (message.rfind(prefix, 0) != 0) return "the message does not start with \"" + prefix + "\"";
  // Not an argument's fault: the machine (no usable GPU, another architecture).
  if (message.compare(prefix.size(), 14, "CUDA error in ") == 0 || message.compare(prefix.size(), 4, "cuda") == 0)
    return "";
  // One of the first few words is the argument ("kv_cache.stride(0) ...", "could not describe q
  // to the TMA unit").
  size_t pos = prefix.size();
  for (int word = 0; word < 5 && pos < message.size(); ++word) {
    size_t end = pos;
    while (end < message.size() &&
           (std::isalnum(static_cast<unsigned char>(message[end])) || message[end] == '_'))
      ++end;
    const std::string id = message.substr(pos, end - pos);
    for (const Arg& a : c.args)
      if (a.name == id) return "";
    for (const char* scalar : {"softmax_scale", "output_scale", "scale_inv", "scale", "k_scale_inv", "v_scale_inv"})
      if (id == scalar) return "";
    pos = message.find(' ', end);
    if (pos == std::string::npos) break;
    ++pos;
  }
  return "the message names no argument in its first words";
}

// Contiguous host copies of the outputs the call wrote (in argument order).
HostTensor gather_elements(const Arg& a, const std::vector<uint8_t>& image, int64_t base) {
  HostTensor t(a.dtype, a.shape.empty() ? std::vector<int64_t>{} : a.shape);
  const std::vector<int64_t> offsets = element_offsets(a, 0);
  const int64_t esize = static_cast<int64_t>(dtype_size(a.dtype));
  for (size_t e = 0; e < offsets.size(); ++e)
    std::memcpy(static_cast<uint8_t*>(t.view().data) + e * esize, image.data() + base + offsets[e], esize);
  return t;
}

// GPU results of the attention and merge kernels differ from the FP64 reference by rounding.
std::string within_tolerance(const Case& c, const Arg& a, const HostTensor& actual, const HostTensor& expected) {
  const bool lse = a.name == "lse";
  const bool fp8 = c.args[0].dtype == DType::kFloat8E4M3;
  double bound = 0;
  switch (c.op) {
    case Op::kDecode:
    case Op::kPrefill:
      // A softmax_scale so large that FP32 loses score differences of a whole exponent unit
      // (the kernels' softmax arithmetic) leaves the problem ill-conditioned there: only the
      // never-out-of-bounds rule applies (docs/device-values.md, "softmax_scale").
      if (c.scale_a > 1e4f) return "";
      bound = lse ? (fp8 ? 4e-2 : 2e-3) : (fp8 ? 6e-2 : 1e-2);
      break;
    case Op::kMerge: bound = lse ? 1e-5 : (a.dtype == DType::kBFloat16 ? 8e-3 : 1e-5); break;
    default: {
      const testing::AssertionResult same = bitwise_equal(actual, expected);
      return same ? "" : a.name + " differs from the reference: " + same.message();
    }
  }
  const ErrorStats s = compare(actual, expected);
  const double error = lse ? s.max_abs : s.rel_l2;
  if (s.nonfinite == 0 && s.mismatched_inf == 0 && error <= bound) return "";
  std::ostringstream os;
  os << a.name << " off the reference: " << s.summary() << " (bound " << bound << ")";
  return os.str();
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kDecode: return "mla_decode";
    case Op::kPrefill: return "mla_prefill";
    case Op::kMerge: return "merge_attn_states";
    case Op::kCacheWrite: return "kv_cache_write";
    case Op::kGatherCache: return "gather_cache";
    case Op::kQuantize: return "quantize_fp8";
    case Op::kPack: return "pack_prefill_kv";
  }
  return "?";
}

std::string Case::describe() const {
  std::ostringstream os;
  os << op_name(op) << "(";
  for (const Arg& a : args) {
    if (!a.present) continue;
    os << a.name << " " << dtype_name(a.dtype) << " [";
    for (size_t d = 0; d < a.shape.size(); ++d) os << (d ? ", " : "") << a.shape[d];
    os << "] strides [";
    for (size_t d = 0; d < a.strides.size(); ++d) os << (d ? ", " : "") << a.strides[d];
    os << "]; ";
  }
  os << "scales " << scale_a << ", " << scale_b << (causal ? ", causal" : "")
     << (v_layout == PrefillValueLayout::kFp8Transposed ? ", v_layout kFp8Transposed" : "") << ") mutations: "
     << (mutations.empty() ? "none" : mutations);
  return os.str();
}

Case make_case(Op op, std::mt19937_64& rng, Target target) {
  Case c;
  switch (op) {
    case Op::kDecode: c = base_decode(rng, target); break;
    case Op::kPrefill: c = base_prefill(rng, target); break;
    case Op::kMerge: c = base_merge(rng, target); break;
    case Op::kCacheWrite:
    case Op::kGatherCache: c = base_cache(op, rng, target); break;
    case Op::kQuantize: c = base_quantize(rng, target); break;
    case Op::kPack: c = base_pack(rng, target); break;
  }
  Plan plan;
  // A quarter of the cases stay valid; the rest get one or two mutations.
  const int64_t count = chance(rng, 0.25) ? 0 : uniform(rng, 1, 2);
  for (int64_t m = 0; m < count; ++m) {
    const std::string what = mutate(c, rng, target, plan);
    if (what != "none") c.mutations += (c.mutations.empty() ? "" : "; ") + what;
  }
  // An output carved from an input's storage starts no earlier than the input's view (which a
  // misalignment mutation may have moved past it), so that the two overlap and the call must
  // be refused.
  for (Arg& a : c.args)
    if (a.inside_of >= 0) a.misalign_bytes = std::max(a.misalign_bytes, c.args[a.inside_of].misalign_bytes);
  // An alias follows its target's layout (and refuses to be one if the target changed).
  for (Arg& a : c.args) {
    if (a.alias_of < 0) continue;
    const Arg& t = c.args[a.alias_of];
    a.shape = t.shape;
    a.strides = t.strides;
    a.misalign_bytes = t.misalign_bytes;
    a.null_data = t.null_data;
    a.on_other_device = t.on_other_device;
    a.present = a.present && t.present;
    if (a.dtype != t.dtype) a.alias_of = -1;
  }
  // Every tensor moved to the other device is a valid call there, not a device mix-up (and, on a
  // CPU target, one whose fake pointers a GPU would dereference): keep the first one home.
  bool all_moved = true;
  for (const Arg& a : c.args) all_moved = all_moved && (!a.present || a.on_other_device);
  if (all_moved) c.args[0].on_other_device = false;
  fill_contents(c, rng);
  for (ValueFault f : plan.faults) apply_fault(c, f, rng, target);
  // A decode workspace as the GPU needs it, for the shapes as mutated (when they make sense).
  if (op == Op::kDecode && target == Target::kGpu && c.args[6].present && c.args[6].dtype == DType::kUInt8 &&
      c.args[6].shape.size() == 1 && c.args[6].shape[0] == 0 && has_gpu()) {
    const Arg& q = c.args[0];
    if (q.shape.size() == 4 && q.shape[0] >= 1 && q.shape[1] >= 1 && q.shape[1] <= kMaxDecodeQLen &&
        q.shape[2] >= 1 && q.shape[2] <= kMaxDecodeHeads) {
      Arg& ws = c.args[6];
      ws.shape = {static_cast<int64_t>(
          mla_decode_workspace_size(q.shape[0], q.shape[2], q.shape[1], device_sm_count(0)))};
      ws.strides = {1};
      ws.misalign_bytes = ws.misalign_bytes ? 16 * ws.misalign_bytes : 0;  // 256-byte alignment is the rule
      ws.values = HostTensor(DType::kUInt8, ws.shape);
    }
  }
  c.must_refuse = clearly_invalid(c);
  return c;
}

Result run_case(const Case& c, Target target) {
  Result r;
  std::vector<Storage> st = materialise(c, target);
  for (size_t i = 0; i < st.size(); ++i) st[i].before = snapshot(st[i], target);
  // What each view reads, element by element, before the call: with zero or overlapping strides
  // several elements share bytes, so this (not the values drawn) is the logical input.
  std::vector<HostTensor> logical(c.args.size());
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    if (a.alias_of >= 0 || !st[i].host) continue;
    logical[i] = a.role == Role::kOutput || numel_of(a) < 0 ? a.values
                                         : gather_elements(a, st[i].before, (target == Target::kGpu ? kGpuMargin : 0) +
                                                                                st[i].data_offset);
  }
  Views views(c.args.size());
  for (size_t i = 0; i < c.args.size(); ++i)
    if (c.args[i].present) views[i] = st[i].view;

  try {
    call(c, views);
    if (target == Target::kGpu) cuda_ok(cudaDeviceSynchronize(), "the call's kernels");
  } catch (const Error& e) {
    r.message = e.what();
    r.failure = names_argument(c, r.message);
    return r;
  } catch (const std::exception& e) {
    r.failure = std::string("threw something other than speedmla::Error: ") + e.what();
    return r;
  }
  r.outcome = Outcome::kMatched;
  if (c.must_refuse) {
    r.failure = "accepted a call that must be refused";
    return r;
  }

  // Nothing outside the written views changed: inputs whole, outputs' gaps, GPU margins.
  std::vector<HostTensor> actual(c.args.size());
  std::vector<bool> written_by_call(c.args.size(), false);
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    const Storage& s = st[i];
    if (!s.host) continue;
    const std::vector<uint8_t> now = snapshot(s, target);
    const int64_t base = target == Target::kGpu ? kGpuMargin : 0;
    std::vector<uint8_t> expected_bytes = s.before;
    bool written = a.present && a.role != Role::kInput;
    for (size_t j = 0; j < c.args.size(); ++j)  // an output aliasing this input writes it
      if (c.args[j].alias_of == static_cast<int>(i) && c.args[j].present && c.args[j].role != Role::kInput)
        written = true;
    if (written) {
      written_by_call[i] = true;
      actual[i] = gather_elements(a, now, base + s.data_offset);
      for (int64_t off : element_offsets(a, base + s.data_offset))
        std::memcpy(expected_bytes.data() + off, now.data() + off, dtype_size(a.dtype));
    }
    if (now != expected_bytes) {
      r.failure = a.name + ": bytes outside what the call may write changed";
      return r;
    }
  }

  // The CPU path on contiguous copies is the expected result.
  std::vector<HostTensor> expected(c.args.size());
  Views canonical(c.args.size());
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    if (a.alias_of >= 0 || !st[i].host) continue;
    expected[i] = logical[i];
    if (a.name == "workspace") continue;  // the CPU takes none
    if (a.present) canonical[i] = expected[i].view();
  }
  for (size_t i = 0; i < c.args.size(); ++i)
    if (c.args[i].alias_of >= 0 && c.args[i].present) canonical[i] = expected[c.args[i].alias_of].view();
  try {
    call(c, canonical);
  } catch (const Error& e) {
    if (target == Target::kGpu && c.values_out_of_contract) return r;  // clamped on the device: safe is enough
    r.failure = std::string("the contiguous CPU call refused what the strided one accepted: ") + e.what();
    return r;
  }
  if (c.values_out_of_contract && target == Target::kGpu) return r;
  // Two rows naming one slot: the GPU may keep either (cache.h), the CPU keeps the later one.
  if (c.op == Op::kCacheWrite && target == Target::kGpu) {
    const HostTensor& slots = logical[find_arg(c, "slots")];
    std::vector<int64_t> valid;
    for (int64_t i = 0; i < slots.numel(); ++i)
      if (slots.data<int64_t>()[i] >= 0) valid.push_back(slots.data<int64_t>()[i]);
    std::sort(valid.begin(), valid.end());
    if (std::adjacent_find(valid.begin(), valid.end()) != valid.end()) return r;
  }
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    if (!written_by_call[i] || a.name == "workspace") continue;
    if (target == Target::kCpu) {
      const testing::AssertionResult same = bitwise_equal(actual[i], expected[i]);
      if (!same) r.failure = a.name + " differs from the contiguous call: " + same.message();
    } else {
      const std::string off = within_tolerance(c, a, actual[i], expected[i]);
      if (!off.empty()) r.failure = off;
    }
    if (!r.failure.empty()) return r;
  }
  return r;
}

}  // namespace speedmla::test::fuzz
