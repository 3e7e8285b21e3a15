// merge_attn_states on the GPU against the CPU path (the FP64 reference), on fresh random data
// with poisoned outputs: FP32 outputs within rel. L2 1e-5, BF16 outputs within one BF16 ulp,
// LSE within 1e-5 and every infinity and NaN where the reference has it.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/error_budget.h"
#include "common/op_testing.h"
#include "common/util.h"
#include "cpu/reference_testing.h"

namespace speedmla::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Success when every BF16 element of `actual` is within one ulp of `expected` (+0 = -0, NaN
// matches NaN) or within 2^-20 of it: the kernel sums w_a*a + w_b*b in FP32, the reference in
// FP64, and where the two O(1) terms nearly cancel, FP32 rounding (~6e-8) is several ulps of
// the tiny result (seen on the H200: -4.14e-6 against -4.08e-6). Otherwise the count and the
// first few mismatches, by flat storage index.
testing::AssertionResult within_one_bf16_ulp(const HostTensor& actual, const HostTensor& expected) {
  auto ordered = [](uint16_t bits) {  // monotonic in the value; +0 and -0 both 0
    return (bits & 0x8000) ? -static_cast<int>(bits & 0x7FFF) : static_cast<int>(bits);
  };
  std::ostringstream first;
  int64_t mismatches = 0;
  for (int64_t i = 0; i < expected.numel(); ++i) {
    const double va = get(actual, i), ve = get(expected, i);
    const bool ok = std::isnan(va) || std::isnan(ve)
                        ? std::isnan(va) && std::isnan(ve)
                        : std::abs(ordered(actual.data<uint16_t>()[i]) -
                                   ordered(expected.data<uint16_t>()[i])) <= 1 ||
                              std::abs(va - ve) <= 0x1p-20;
    if (ok || ++mismatches > 5) continue;
    first << "\n  [" << i << "] got " << va << ", expected " << ve;
  }
  if (mismatches == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << mismatches << " of " << expected.numel()
                                     << " elements differ by more than one BF16 ulp:" << first.str();
}

struct MergeDtypes {
  DType out_a, out_b, out;
};

void PrintTo(const MergeDtypes& d, std::ostream* os) {
  *os << dtype_name(d.out_a) << " + " << dtype_name(d.out_b) << " -> " << dtype_name(d.out);
}

std::string dtypes_name(const testing::TestParamInfo<MergeDtypes>& info) {
  return std::string(dtype_name(info.param.out_a)) + "_" + dtype_name(info.param.out_b) + "_to_" +
         dtype_name(info.param.out);
}

struct MergeCase {
  int64_t tokens, heads, dim;
  int64_t pad = 0;       // elements after each head row of out_a, out_b and out (strided views)
  int64_t offset = 0;    // of out_a, in elements: odd breaks 16-byte alignment (scalar path)
  bool in_place = false;  // out = out_a, lse = lse_a
  bool with_lse = true;
};

// [T, H, D] with head stride D + pad.
Mirror states(DType dtype, const MergeCase& c, int64_t offset = 0) {
  const int64_t head_stride = c.dim + c.pad;
  return Mirror(dtype, {c.tokens, c.heads, c.dim}, {c.heads * head_stride, head_stride, 1}, offset);
}

// Sets row (t, h) of the [T, H, D] host view of `m` to `value`.
void fill_row(Mirror& m, int64_t t, int64_t h, double value) {
  const TensorView& v = m.host_view();
  const int64_t base = (static_cast<char*>(v.data) - static_cast<char*>(m.host.view().data)) /
                           static_cast<int64_t>(dtype_size(v.dtype)) +
                       t * v.stride(0) + h * v.stride(1);
  for (int64_t d = 0; d < v.size(2); ++d) set(m.host, base + d, value);
}

class MergeGpu : public testing::TestWithParam<MergeDtypes> {};

TEST_P(MergeGpu, MatchesReference) {
  SPEEDMLA_REQUIRE_GPU();
  std::mt19937_64 rng = seeded_rng();
  const MergeDtypes dt = GetParam();
  const MergeCase cases[] = {
      {0, 16, 512},
      {1, 1, 512},
      {7, 16, 512, /*pad=*/64},
      {33, 128, 128},
      {5, 3, 72},                         // 9 chunks of 8: lanes grouped by 16
      {5, 3, 7},                          // odd head_dim: scalar path
      {9, 4, 128, 0, /*offset=*/1},       // misaligned out_a: scalar path
      {12, 16, 512, 8, 0, /*in_place=*/true},
      {6, 8, 128, 0, 0, false, /*with_lse=*/false},
      {10, 2, 256, 0, 0, true, false},
  };
  std::uniform_real_distribution<double> lse_value(-8.0, 8.0);
  std::uniform_int_distribution<int> special(0, 49);
  for (const MergeCase& c : cases) {
    if (c.in_place && dt.out != dt.out_a) continue;
    Mirror out_a = states(dt.out_a, c, c.offset), out_b = states(dt.out_b, c);
    Mirror lse_a(DType::kFloat32, {c.tokens, c.heads}), lse_b(DType::kFloat32, {c.tokens, c.heads});
    fill_uniform(out_a.host, rng, -2.0, 2.0);
    fill_uniform(out_b.host, rng, -2.0, 2.0);
    // Rows with special LSEs; a part with lse -inf holds NaN, which must not reach the result.
    for (int64_t t = 0; t < c.tokens; ++t) {
      for (int64_t h = 0; h < c.heads; ++h) {
        double la = lse_value(rng), lb = lse_value(rng);
        switch (special(rng)) {
          case 0: la = -kInf; break;
          case 1: lb = -kInf; break;
          case 2: case 3: la = lb = -kInf; break;
          case 4: la = kNaN; break;
          case 5: lb = kInf; break;
          case 6: la = lb = kInf; break;
          case 7: lb = la; break;
          default: break;
        }
        set(lse_a.host, t * c.heads + h, la);
        set(lse_b.host, t * c.heads + h, lb);
        if (la == -kInf) fill_row(out_a, t, h, kNaN);
        if (lb == -kInf) fill_row(out_b, t, h, kNaN);
      }
    }
    for (Mirror* m : {&out_a, &out_b, &lse_a, &lse_b}) m->upload();
    std::optional<Mirror> own_out, own_lse;
    if (!c.in_place) {
      own_out.emplace(states(dt.out, c));
      own_out->poison();
      if (c.with_lse) {
        own_lse.emplace(DType::kFloat32, std::vector<int64_t>{c.tokens, c.heads});
        own_lse->poison();
      }
    }
    Mirror& out = c.in_place ? out_a : *own_out;
    Mirror* lse = c.with_lse ? (c.in_place ? &lse_a : &*own_lse) : nullptr;
    SCOPED_TRACE(testing::Message() << "T=" << c.tokens << " H=" << c.heads << " D=" << c.dim
                                    << " out_a " << out_a.layout() << " out_b " << out_b.layout()
                                    << " out " << out.layout() << (c.in_place ? " in place" : "")
                                    << (c.with_lse ? "" : " without lse"));

    merge_attn_states(out_a.host_view(), lse_a.host_view(), out_b.host_view(), lse_b.host_view(),
                      out.host_view(), lse ? std::optional(lse->host_view()) : std::nullopt);
    merge_attn_states(out_a.device_view(), lse_a.device_view(), out_b.device_view(),
                      lse_b.device_view(), out.device_view(),
                      lse ? std::optional(lse->device_view()) : std::nullopt);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    const HostTensor gpu_out = out.download();
    const ErrorStats out_error = compare(gpu_out, out.host);
    if (dt.out == DType::kBFloat16) {
      EXPECT_TRUE(within_one_bf16_ulp(gpu_out, out.host));
    } else {
      EXPECT_LT(out_error.rel_l2, merge_bounds(dt.out).out_rel_l2) << out_error.summary();
      EXPECT_EQ(out_error.nonfinite, 0) << out_error.summary();
      EXPECT_EQ(out_error.mismatched_inf, 0) << out_error.summary();
    }
    double lse_error = -1;
    if (lse) {
      const ErrorStats s = compare(lse->download(), lse->host);
      lse_error = s.max_abs;
      EXPECT_LT(s.max_abs, merge_bounds(dt.out).lse_max_abs) << "lse " << s.summary();
      EXPECT_EQ(s.nonfinite, 0) << "lse " << s.summary();
      EXPECT_EQ(s.mismatched_inf, 0) << "lse " << s.summary();
    }
    record_error("merge_attn_states", dt.out, out_error.rel_l2, out_error.max_abs, lse_error);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, MergeGpu,
    testing::Values(MergeDtypes{DType::kBFloat16, DType::kBFloat16, DType::kBFloat16},
                    MergeDtypes{DType::kFloat32, DType::kFloat32, DType::kFloat32},
                    MergeDtypes{DType::kBFloat16, DType::kFloat32, DType::kBFloat16},
                    MergeDtypes{DType::kFloat32, DType::kBFloat16, DType::kFloat32},
                    MergeDtypes{DType::kFloat32, DType::kFloat32, DType::kBFloat16}),
    dtypes_name);

}  // namespace
}  // namespace speedmla::test
