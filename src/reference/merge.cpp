// Reference merge of two partial attention states by their LSE (speedmla/merge.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "reference/element.h"
#include "reference/parallel.h"
#include "speedmla/reference.h"

namespace speedmla::reference {
namespace {

// exp(lse - max_lse), taken as 1 when lse is the maximum so that two +inf states (infinitely
// heavy) weigh equally instead of giving inf - inf = NaN.
double relative_weight(double lse, double max_lse) {
  return lse == max_lse ? 1.0 : std::exp(lse - max_lse);
}

}  // namespace

// out may alias out_a and lse may alias lse_a: each (t, h) task reads all of its inputs before it
// writes its outputs, and no task touches another's elements.
void merge_attn_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                       const TensorView& lse_b, const TensorView& out,
                       const std::optional<TensorView>& lse) {
  const int64_t tokens = out_a.size(0), num_heads = out_a.size(1), head_dim = out_a.size(2);
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  parallel_for(tokens * num_heads, 3 * head_dim, [&](int64_t row) {
    const int64_t t = row / num_heads, h = row % num_heads;
    const double la = load(lse_a, offset_of(lse_a, t, h));
    const double lb = load(lse_b, offset_of(lse_b, t, h));
    std::vector<double> a(static_cast<size_t>(head_dim)), b(static_cast<size_t>(head_dim));
    load_row(out_a, offset_of(out_a, t, h), head_dim, a.data());
    load_row(out_b, offset_of(out_b, t, h), head_dim, b.data());

    double merged_lse;
    if (std::isnan(la) || std::isnan(lb)) {
      merged_lse = kNaN;
      std::fill(a.begin(), a.end(), kNaN);
    } else if (la == kNegInf && lb == kNegInf) {  // neither part saw a key
      merged_lse = kNegInf;
      std::fill(a.begin(), a.end(), 0.0);
    } else {
      const double m = std::max(la, lb);
      const double wa = relative_weight(la, m), wb = relative_weight(lb, m);
      // A part of weight 0 (an empty part, lse -inf) is left out rather than multiplied by 0,
      // so whatever its output holds cannot turn the result into NaN.
      for (int64_t d = 0; d < head_dim; ++d) {
        const double sum = (wa > 0 ? wa * a[d] : 0.0) + (wb > 0 ? wb * b[d] : 0.0);
        a[d] = sum / (wa + wb);
      }
      merged_lse = m + std::log(wa + wb);
    }
    store_row(out, offset_of(out, t, h), head_dim, a.data());
    if (lse) store(*lse, offset_of(*lse, t, h), merged_lse);
  });
}

}  // namespace speedmla::reference
