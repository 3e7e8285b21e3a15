// A random mla_prefill problem on the host, its CPU reference, its copy on the device, and the
// per-request comparison of a GPU result with the reference (what tests/gpu/prefill_test.cpp and
// the backend's chunked-prefix tests assert on).
//
// Data: normal, std 1 (activations after a norm), drawn in the problem's dtype; FP8 problems
// hold the e4m3 roundings of such values and the reference reads those FP8 values. Rows past the
// last request (spare rows) and the gaps of strided layouts hold NaN in k and v, so that a kernel
// reading a key no request owns shows up as NaN.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/util.h"

namespace speedmla::test {

struct PrefillLengths {
  int32_t q = 0, k = 0;  // len_q, len_k of one request
};

struct PrefillProblemSpec {
  std::string name;  // the case: report lines, failure messages and the data's seed (case_rng)
  DType dtype = DType::kBFloat16;
  int64_t heads = 16, kv_heads = 16;
  bool causal = true;
  std::vector<PrefillLengths> requests;
  int64_t spare_rows = 2;  // rows past cu_seqlens[B] in q, k, v and out
  int64_t head_pad = 0;    // elements after each head's dims (head stride = D + head_pad)
  int64_t token_pad = 0;   // elements after each token's heads (token stride = H * head stride + token_pad)
  float softmax_scale = 0.0721688f;  // 1/sqrt(192)
  float output_scale = 1.f;
  // kFp8Transposed (FP8): the GPU runs on v_transposed, the same values in that layout.
  PrefillValueLayout v_layout = PrefillValueLayout::kTokenMajor;
  std::string label() const;  // "bfloat16 <name> H=16/1 causal B=12"
};

struct PrefillProblem {
  PrefillProblemSpec spec;
  HostTensor q_storage, k_storage, v_storage, cu_q, cu_k;
  TensorView q, k, v;  // views of the storages: [total_q, H, 192], [total_k, H_kv, 192], [total_k, H_kv, 128]
  // v_layout kFp8Transposed: v's bytes (spare rows' NaN included) as [H_kv, 128, T] (prefill.h),
  // T = total_k rounded up to 16 plus 16; positions past total_k hold NaN.
  HostTensor v_transposed;
  std::vector<int64_t> q_begin, k_begin;  // cu_seqlens as int64 (B + 1 entries)
  int64_t batch() const { return static_cast<int64_t>(spec.requests.size()); }
};

PrefillProblem make_prefill_problem(const PrefillProblemSpec& spec);

// FP8 values v [T, H, 128] (host, any strides) in the kFp8Transposed layout: [H, 128, positions]
// (positions >= T, a multiple of 16), NaN at the positions of tokens >= T.
HostTensor transposed_values(const TensorView& v, int64_t positions);

// out [total_q, H, 128] BF16 and lse [total_q, H] FP32, contiguous.
struct PrefillResult {
  HostTensor out, lse;
};

// The CPU reference of the whole problem (rows past the last request stay zero).
PrefillResult prefill_reference(const PrefillProblem& pb);

// The reference of chosen query rows of request b, each run as a one-row request over the keys
// it sees (causal: keys [0, i + len_k - len_q]); row n of the result is query row rows[n] of
// the request. For long requests, whose full reference would take minutes.
PrefillResult prefill_reference_rows(const PrefillProblem& pb, int64_t b, const std::vector<int64_t>& rows);

// `count` query rows of a request of len_q rows: the first and last two, every tile boundary
// of 64 and 128 rows ±1 up to 1K and a few beyond, and random rows; sorted, distinct.
std::vector<int64_t> sample_rows(int64_t len_q, int64_t random_rows, std::mt19937_64& rng);

// Rows first_row + rows[n] of `r`, as a result of rows.size() rows.
PrefillResult select_rows(const PrefillResult& r, int64_t first_row, const std::vector<int64_t>& rows);

// A view of the same layout at the same offset inside `device_storage` as `host_view` has inside
// `host_storage`.
TensorView device_view_of(const TensorView& host_view, const HostTensor& host_storage,
                          const DeviceTensor& device_storage);

// The problem on the current device, out and lse allocated.
struct DevicePrefill {
  DeviceTensor q_storage, k_storage, v_storage, v_transposed, cu_q, cu_k, out, lse;
  TensorView q, k, v;  // v: v_transposed's view where the problem's layout is kFp8Transposed
  explicit DevicePrefill(const PrefillProblem& pb);
  // Poisons out and lse (0xFF: NaN) and runs mla_prefill; then waits for the device.
  void run(const PrefillProblemSpec& spec);
  PrefillResult download() const;
};

// How far a result is from the reference, request by request.
struct RequestErrors {
  int64_t request = 0, len_q = 0, len_k = 0;
  ErrorStats out, lse;
  int64_t nonzero_empty_rows = 0;  // (row, head) with reference lse -inf whose out is not exactly 0
};
struct PrefillErrors {
  std::vector<RequestErrors> requests;
  double worst_out = 0, worst_lse = 0;  // over requests: out rel L2, lse max |error|
  int64_t touched_spare = 0;            // elements of out/lse past the last request that changed
};
// Whole results (every request, and the spare rows after them).
PrefillErrors compare_prefill(const PrefillProblem& pb, const PrefillResult& actual, const PrefillResult& expected);
// The same for the sampled rows of one request (results from select_rows / prefill_reference_rows).
RequestErrors compare_rows(const PrefillProblem& pb, int64_t b, const PrefillResult& actual,
                           const PrefillResult& expected);

struct PrefillBounds {
  double out_rel_l2, lse_max_abs;
};
// One gtest failure per request out of bounds (naming it), one for touched spare rows.
void expect_within(const PrefillProblem& pb, const PrefillErrors& errors, const PrefillBounds& bounds);
void expect_within(const PrefillProblem& pb, const RequestErrors& errors, const PrefillBounds& bounds);
// The report line gpu-check.sh reads: "[ prefill ] <dtype> <case> out rel_l2=... lse max_abs=...".
void report(const PrefillProblem& pb, double worst_out, double worst_lse, const std::string& note = "");

}  // namespace speedmla::test
