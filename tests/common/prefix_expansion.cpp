#include "common/prefix_expansion.h"

#include <stdexcept>
#include <string>

#include "common/prefill_problem.h"
#include "common/util.h"
#include "reference/element.h"

namespace speedmla::test {
namespace {

constexpr int64_t kNope = 128, kRope = 64;  // k_nope (= v) width per head, rope width

}  // namespace

PrefixExpansion::PrefixExpansion(int64_t heads, std::mt19937_64& rng) : heads_(heads) {
  std::uniform_real_distribution<double> dist(-0.5, 0.5);
  wk_.resize(static_cast<size_t>(heads * kUsedLatent * kNope));
  wv_.resize(wk_.size());
  for (double& w : wk_) w = dist(rng);
  for (double& w : wv_) w = dist(rng);
}

void PrefixExpansion::operator()(const TensorView& latent, const TensorView& k, const TensorView& v) const {
  using reference::load;
  using reference::offset_of;
  using reference::store;
  for (int64_t t = 0; t < latent.shape[0]; ++t) {
    double x[kUsedLatent];
    for (int64_t j = 0; j < kUsedLatent; ++j) x[j] = load(latent, offset_of(latent, t, j));
    for (int64_t h = 0; h < heads_; ++h) {
      for (int64_t d = 0; d < kNope; ++d) {
        double sk = 0, sv = 0;
        for (int64_t j = 0; j < kUsedLatent; ++j) {
          sk += x[j] * wk_[(h * kUsedLatent + j) * kNope + d];
          sv += x[j] * wv_[(h * kUsedLatent + j) * kNope + d];
        }
        store(k, offset_of(k, t, h, d), sk);
        store(v, offset_of(v, t, h, d), sv);
      }
      for (int64_t r = 0; r < kRope; ++r)
        store(k, offset_of(k, t, h, kNope + r), load(latent, offset_of(latent, t, kLatentDim + r)));
    }
  }
}

void PrefixExpansion::on_device(const TensorView& latent, const TensorView& k, const TensorView& v,
                                PrefillValueLayout v_layout) const {
  if (!latent.is_contiguous() || !k.is_contiguous() || !v.is_contiguous())
    throw std::runtime_error("PrefixExpansion::on_device: the views must be contiguous");
  const bool transposed = v_layout == PrefillValueLayout::kFp8Transposed;
  const auto shape_of = [](const TensorView& t) { return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim); };
  HostTensor latent_host(latent.dtype, shape_of(latent)), k_host(k.dtype, shape_of(k));
  HostTensor v_host(v.dtype, transposed ? std::vector<int64_t>{latent.shape[0], heads_, kPrefillVDim} : shape_of(v));
  copy_from_device(latent, latent_host);
  (*this)(latent_host.view(), k_host.view(), v_host.view());
  copy_to_device(k_host, k);
  copy_to_device(transposed ? transposed_values(v_host.view(), v.shape[2]) : v_host, v);
}

}  // namespace speedmla::test
