#include "common/prefill_problem.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "backend/views.h"
#include "common/error_budget.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

// A [rows, heads, dim] view into a flat storage with the spec's padding; the storage holds NaN.
TensorView padded_view(HostTensor& storage, int64_t rows, int64_t heads, int64_t dim, const PrefillProblemSpec& s) {
  const int64_t head_stride = dim + s.head_pad, token_stride = heads * head_stride + s.token_pad;
  storage = HostTensor(s.dtype, {std::max<int64_t>(rows * token_stride, 1)});
  fill_bytes(storage, 0xFF);
  TensorView v = storage.view();
  v.ndim = 3;
  v.shape = {rows, heads, dim};
  v.strides = {token_stride, head_stride, 1};
  return v;
}

// Writes normal (std 1) values, rounded to the view's dtype, into rows [0, rows) of `view`.
// Values come from a table of 2^16 draws of this problem's generator, picked by 16 random bits
// each: a hundred million elements fill in about a second, where one normal draw per element
// would take several.
void fill_normal(const TensorView& view, int64_t rows, std::mt19937_64& rng) {
  const size_t esize = dtype_size(view.dtype);
  std::vector<uint16_t> codes(1 << 16);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& c : codes) {
    const float x = normal(rng);
    c = view.dtype == DType::kFloat8E4M3 ? float_to_fp8_e4m3(x) : float_to_bf16(x);
  }
  auto* base = static_cast<uint8_t*>(view.data);
  uint64_t bits = 0;
  int left = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < view.shape[1]; ++h) {
      uint8_t* row = base + (r * view.strides[0] + h * view.strides[1]) * esize;
      for (int64_t d = 0; d < view.shape[2]; ++d) {
        if (left == 0) {
          bits = rng();
          left = 4;
        }
        const uint16_t code = codes[bits & 0xFFFF];
        bits >>= 16;
        --left;
        if (esize == 1) row[d] = static_cast<uint8_t>(code);
        else std::memcpy(row + 2 * d, &code, 2);
      }
    }
}

HostTensor cumulative(const std::vector<int64_t>& begins) {
  HostTensor t(DType::kInt32, {static_cast<int64_t>(begins.size())});
  for (size_t i = 0; i < begins.size(); ++i) t.data<int32_t>()[i] = static_cast<int32_t>(begins[i]);
  return t;
}

PrefillResult empty_result(int64_t rows, int64_t heads) {
  return {HostTensor(DType::kBFloat16, {rows, heads, kPrefillVDim}), HostTensor(DType::kFloat32, {rows, heads})};
}

// Errors over rows [row_begin, row_end) of two results of `heads` heads.
RequestErrors errors_over(const PrefillResult& actual, const PrefillResult& expected, int64_t row_begin,
                          int64_t row_end, int64_t heads) {
  RequestErrors e;
  e.out = compare(actual.out, expected.out, row_begin * heads * kPrefillVDim, row_end * heads * kPrefillVDim);
  e.lse = compare(actual.lse, expected.lse, row_begin * heads, row_end * heads);
  for (int64_t i = row_begin * heads; i < row_end * heads; ++i) {
    if (get(expected.lse, i) != -INFINITY) continue;
    for (int64_t d = 0; d < kPrefillVDim; ++d)
      if (get(actual.out, i * kPrefillVDim + d) != 0.0) {
        ++e.nonzero_empty_rows;
        break;
      }
  }
  return e;
}

}  // namespace

std::string PrefillProblemSpec::label() const {
  std::ostringstream os;
  os << dtype_name(dtype) << " " << name << " H=" << heads << "/" << kv_heads << (causal ? " causal" : " full")
     << " B=" << requests.size();
  if (head_pad || token_pad) os << " pad=" << head_pad << "," << token_pad;
  if (v_layout == PrefillValueLayout::kFp8Transposed) os << " v-transposed";
  return os.str();
}

PrefillProblem make_prefill_problem(const PrefillProblemSpec& spec) {
  PrefillProblem pb;
  pb.spec = spec;
  pb.q_begin = {0};
  pb.k_begin = {0};
  for (const PrefillLengths& r : spec.requests) {
    pb.q_begin.push_back(pb.q_begin.back() + r.q);
    pb.k_begin.push_back(pb.k_begin.back() + r.k);
  }
  const int64_t total_q = pb.q_begin.back() + spec.spare_rows, total_k = pb.k_begin.back() + spec.spare_rows;
  pb.q = padded_view(pb.q_storage, total_q, spec.heads, kPrefillQkDim, spec);
  pb.k = padded_view(pb.k_storage, total_k, spec.kv_heads, kPrefillQkDim, spec);
  pb.v = padded_view(pb.v_storage, total_k, spec.kv_heads, kPrefillVDim, spec);
  std::mt19937_64 rng = case_rng(spec.label());
  fill_normal(pb.q, total_q, rng);  // spare query rows too: whatever a kernel makes of them stays unwritten
  fill_normal(pb.k, pb.k_begin.back(), rng);
  fill_normal(pb.v, pb.k_begin.back(), rng);
  pb.cu_q = cumulative(pb.q_begin);
  pb.cu_k = cumulative(pb.k_begin);
  if (spec.v_layout == PrefillValueLayout::kFp8Transposed)
    pb.v_transposed = transposed_values(pb.v, fp8_transposed_value_positions(total_k) + 16);
  return pb;
}

HostTensor transposed_values(const TensorView& v, int64_t positions) {
  const int64_t tokens = v.shape[0], heads = v.shape[1];
  HostTensor out(DType::kFloat8E4M3, {heads, kPrefillVDim, positions});
  fill_bytes(out, 0xFF);  // NaN: positions no token owns
  const auto* from = static_cast<const uint8_t*>(v.data);
  auto* to = out.data<uint8_t>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < kPrefillVDim; ++d)
        to[(h * kPrefillVDim + d) * positions + fp8_transposed_value_position(t)] =
            from[t * v.strides[0] + h * v.strides[1] + d * v.strides[2]];
  return out;
}

PrefillResult prefill_reference(const PrefillProblem& pb) {
  PrefillResult r = empty_result(pb.q.shape[0], pb.spec.heads);
  reference::mla_prefill(pb.q, pb.k, pb.v, pb.cu_q.view(), pb.cu_k.view(), r.out.view(), r.lse.view(),
                         pb.spec.causal, pb.spec.softmax_scale, pb.spec.output_scale);
  return r;
}

PrefillResult prefill_reference_rows(const PrefillProblem& pb, int64_t b, const std::vector<int64_t>& rows) {
  const auto& s = pb.spec;
  const int64_t len_q = s.requests[b].q, len_k = s.requests[b].k;
  PrefillResult r = empty_result(static_cast<int64_t>(rows.size()), s.heads);
  for (size_t n = 0; n < rows.size(); ++n) {
    const int64_t i = rows[n];
    const int64_t visible = s.causal ? std::clamp<int64_t>(i + len_k - len_q + 1, 0, len_k) : len_k;
    const HostTensor cu_q = cumulative({0, 1}), cu_k = cumulative({0, visible});
    // The keys given are exactly the visible ones, so the one-row request is non-causal.
    reference::mla_prefill(detail::slice_rows(pb.q, pb.q_begin[b] + i, 1),
                           detail::slice_rows(pb.k, pb.k_begin[b], visible),
                           detail::slice_rows(pb.v, pb.k_begin[b], visible), cu_q.view(), cu_k.view(),
                           detail::slice_rows(r.out.view(), static_cast<int64_t>(n), 1),
                           detail::slice_rows(r.lse.view(), static_cast<int64_t>(n), 1), /*causal=*/false,
                           s.softmax_scale, s.output_scale);
  }
  return r;
}

std::vector<int64_t> sample_rows(int64_t len_q, int64_t random_rows, std::mt19937_64& rng) {
  std::vector<int64_t> rows{0, 1, len_q - 2, len_q - 1};
  for (int64_t edge = 64; edge <= 1024; edge += 64)
    for (int64_t d : {-1, 0, 1}) rows.push_back(edge + d);
  for (int64_t edge = 2048; edge < len_q; edge *= 2)
    for (int64_t d : {-1, 0, 1}) rows.push_back(edge + d);
  std::uniform_int_distribution<int64_t> any(0, std::max<int64_t>(len_q - 1, 0));
  for (int64_t n = 0; n < random_rows; ++n) rows.push_back(any(rng));
  std::erase_if(rows, [&](int64_t r) { return r < 0 || r >= len_q; });
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

PrefillResult select_rows(const PrefillResult& r, int64_t first_row, const std::vector<int64_t>& rows) {
  const int64_t heads = r.lse.view().shape[1];
  PrefillResult s = empty_result(static_cast<int64_t>(rows.size()), heads);
  const size_t out_row = heads * kPrefillVDim * sizeof(uint16_t), lse_row = heads * sizeof(float);
  for (size_t n = 0; n < rows.size(); ++n) {
    const int64_t row = first_row + rows[n];
    std::memcpy(s.out.data<uint8_t>() + n * out_row, r.out.data<uint8_t>() + row * out_row, out_row);
    std::memcpy(s.lse.data<uint8_t>() + n * lse_row, r.lse.data<uint8_t>() + row * lse_row, lse_row);
  }
  return s;
}

TensorView device_view_of(const TensorView& host_view, const HostTensor& host_storage,
                          const DeviceTensor& device_storage) {
  TensorView v = host_view;
  const auto offset = static_cast<const uint8_t*>(host_view.data) - static_cast<const uint8_t*>(host_storage.view().data);
  v.data = static_cast<uint8_t*>(device_storage.view().data) + offset;
  v.device = device_storage.view().device;
  return v;
}

DevicePrefill::DevicePrefill(const PrefillProblem& pb)
    : q_storage(pb.q_storage), k_storage(pb.k_storage), v_storage(pb.v_storage), cu_q(pb.cu_q), cu_k(pb.cu_k),
      out(DType::kBFloat16, {pb.q.shape[0], pb.spec.heads, kPrefillVDim}),
      lse(DType::kFloat32, {pb.q.shape[0], pb.spec.heads}) {
  q = device_view_of(pb.q, pb.q_storage, q_storage);
  k = device_view_of(pb.k, pb.k_storage, k_storage);
  v = device_view_of(pb.v, pb.v_storage, v_storage);
  if (pb.spec.v_layout == PrefillValueLayout::kFp8Transposed) {
    v_transposed = DeviceTensor(pb.v_transposed);
    v = v_transposed.view();
  }
}

void DevicePrefill::run(const PrefillProblemSpec& s) {
  out.fill_bytes(0xFF);  // every element a request owns must be written
  lse.fill_bytes(0xFF);
  mla_prefill(q, k, v, s.v_layout, cu_q.view(), cu_k.view(), out.view(), lse.view(), s.causal, s.softmax_scale,
              s.output_scale);
  const cudaError_t status = cudaDeviceSynchronize();
  if (status != cudaSuccess) throw std::runtime_error(std::string("mla_prefill: ") + cudaGetErrorString(status));
}

PrefillResult DevicePrefill::download() const { return {out.to_host(), lse.to_host()}; }

PrefillErrors compare_prefill(const PrefillProblem& pb, const PrefillResult& actual, const PrefillResult& expected) {
  PrefillErrors errors;
  const int64_t heads = pb.spec.heads;
  for (int64_t b = 0; b < pb.batch(); ++b) {
    RequestErrors e = errors_over(actual, expected, pb.q_begin[b], pb.q_begin[b + 1], heads);
    e.request = b;
    e.len_q = pb.spec.requests[b].q;
    e.len_k = pb.spec.requests[b].k;
    errors.worst_out = std::max(errors.worst_out, e.out.rel_l2);
    errors.worst_lse = std::max(errors.worst_lse, e.lse.max_abs);
    errors.requests.push_back(e);
  }
  // Rows past the last request keep the poison, bit for bit.
  for (int64_t i = pb.q_begin.back() * heads; i < actual.lse.numel(); ++i) {
    errors.touched_spare += actual.lse.data<uint32_t>()[i] != 0xFFFFFFFFu;
    for (int64_t d = 0; d < kPrefillVDim; ++d)
      errors.touched_spare += actual.out.data<uint16_t>()[i * kPrefillVDim + d] != 0xFFFFu;
  }
  return errors;
}

RequestErrors compare_rows(const PrefillProblem& pb, int64_t b, const PrefillResult& actual,
                           const PrefillResult& expected) {
  RequestErrors e = errors_over(actual, expected, 0, actual.lse.view().shape[0], pb.spec.heads);
  e.request = b;
  e.len_q = pb.spec.requests[b].q;
  e.len_k = pb.spec.requests[b].k;
  return e;
}

void expect_within(const PrefillProblem& pb, const RequestErrors& e, const PrefillBounds& bounds) {
  const bool ok = e.out.nonfinite == 0 && e.out.mismatched_inf == 0 && e.lse.nonfinite == 0 &&
                  e.lse.mismatched_inf == 0 && e.nonzero_empty_rows == 0 && e.out.rel_l2 <= bounds.out_rel_l2 &&
                  e.lse.max_abs <= bounds.lse_max_abs;
  EXPECT_TRUE(ok) << pb.spec.label() << ": request " << e.request << " (len_q " << e.len_q << ", len_k " << e.len_k
                  << "): out " << e.out.summary() << " (bound " << bounds.out_rel_l2 << ") | lse " << e.lse.summary()
                  << " (bound " << bounds.lse_max_abs << ") | rows without keys whose out is not 0: "
                  << e.nonzero_empty_rows;
}

void expect_within(const PrefillProblem& pb, const PrefillErrors& errors, const PrefillBounds& bounds) {
  for (const RequestErrors& e : errors.requests) expect_within(pb, e, bounds);
  EXPECT_EQ(errors.touched_spare, 0) << pb.spec.label() << ": elements of out/lse past the last request were written";
}

void report(const PrefillProblem& pb, double worst_out, double worst_lse, const std::string& note) {
  std::printf("[ prefill ] %-58s out rel_l2=%.3g lse max_abs=%.3g%s%s\n", pb.spec.label().c_str(), worst_out,
              worst_lse, note.empty() ? "" : " ", note.c_str());
  record_error("mla_prefill", pb.spec.dtype, worst_out, -1, worst_lse);
}

}  // namespace speedmla::test
