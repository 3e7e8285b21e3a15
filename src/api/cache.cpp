// kv_cache_write and gather_cache: validation, then the CPU reference or the GPU kernels.
// kv_cache_write's halves are also the library's own entry points (api/cache_internal.h).
#include "speedmla/cache.h"

#include <cuda_runtime_api.h>

#include "api/cache_layout.h"
#include "api/cache_internal.h"
#include "api/check.h"
#include "kernels/cache/gather_cache.h"
#include "kernels/cache/kv_cache_write.h"
#include "kernels/check/value_checks.h"
#include "speedmla/check.h"
#include "speedmla/decode.h"
#include "speedmla/reference.h"

namespace speedmla {
namespace {

// Checks kv_cache [num_pages, page_size, 576] (the shared layout; FP8 or BF16; 16-byte
// aligned) and describes it for the kernels.
// The kernels' description of a kv_cache that check_cache accepted.
kernels::PagedCache paged_cache(const TensorView& kv_cache) {
  return {kv_cache.data, kv_cache.dtype, kv_cache.stride(0), kv_cache.size(1), kv_cache.size(0) * kv_cache.size(1)};
}

kernels::PagedCache check_cache(const detail::ArgChecker& check, const TensorView& kv_cache) {
  detail::check_cache_layout(check, kv_cache);
  check.dtype(kv_cache, "kv_cache", {DType::kFloat8E4M3, DType::kBFloat16});
  check.aligned(kv_cache, "kv_cache", 16);
  return paged_cache(kv_cache);
}

void check_slots(const detail::ArgChecker& check, const TensorView& slots,
                 const TensorView& kv_cache) {
  check.defined(slots, "slots", 1);
  check.dtype(slots, "slots", {DType::kInt64});
  check.same_device(slots, "slots", kv_cache.device);
}

// The check mode (speedmla/check.h): flags slots past the cache. After validation, with the
// device current.
void check_slot_values(const char* function, const TensorView& slots, const kernels::PagedCache& cache,
                       Stream stream) {
  if (!device_checks_enabled()) return;
  const kernels::SlotsCheck values{slots.ptr<const int64_t>(), slots.stride(0), slots.size(0), cache.num_slots};
  if (!slots.is_cuda()) return kernels::check_slots_on_host(values);
  kernels::run_check_slots(values, stream);
  detail::check_cuda(cudaGetLastError(), function, "the check mode's validation kernel launch");
}

}  // namespace

namespace detail {

void validate_kv_cache_write_inputs(const ArgChecker& check, const TensorView& kv_cache, const TensorView& slots,
                                    const TensorView& latent, const TensorView& rope, float scale_inv) {
  check_slots(check, slots, kv_cache);
  const int64_t tokens = slots.size(0);
  auto check_input = [&](const TensorView& t, const char* name, int64_t width) {
    check.defined(t, name, 2);
    check.dtype(t, name, {DType::kBFloat16, DType::kFloat16, DType::kFloat32});
    check.dim(t, name, 0, tokens);
    check.dim(t, name, 1, width);
    check.last_dim_contiguous(t, name);
    check.same_device(t, name, kv_cache.device);
    check.disjoint(kv_cache, "kv_cache", t, name);
  };
  check_input(latent, "latent", kLatentDim);
  check_input(rope, "rope", kRopeDim);
  check.disjoint(kv_cache, "kv_cache", slots, "slots");
  check.finite(scale_inv, "scale_inv");
}

void run_kv_cache_write_validated(const ArgChecker& check, const TensorView& kv_cache, const TensorView& slots,
                                  const TensorView& latent, const TensorView& rope, float scale_inv,
                                  Stream stream) {
  const DeviceGuard guard(kv_cache.device, check.function());
  check_slot_values(check.function(), slots, paged_cache(kv_cache), stream);
  if (!kv_cache.is_cuda()) return reference::kv_cache_write(kv_cache, slots, latent, rope, scale_inv);
  kernels::run_kv_cache_write({.cache = paged_cache(kv_cache),
                               .slots = slots.ptr<const int64_t>(),
                               .slot_stride = slots.stride(0),
                               .latent = latent.data,
                               .latent_dtype = latent.dtype,
                               .latent_stride = latent.stride(0),
                               .rope = rope.data,
                               .rope_dtype = rope.dtype,
                               .rope_stride = rope.stride(0),
                               .num_tokens = slots.size(0),
                               .scale_inv = scale_inv},
                              stream);
  check_cuda(cudaGetLastError(), check.function(), "kernel launch");
}

}  // namespace detail

void kv_cache_write(const TensorView& kv_cache, const TensorView& slots, const TensorView& latent,
                    const TensorView& rope, float scale_inv, Stream stream) {
  const detail::ArgChecker check("kv_cache_write");
  check_cache(check, kv_cache);
  detail::validate_kv_cache_write_inputs(check, kv_cache, slots, latent, rope, scale_inv);
  detail::run_kv_cache_write_validated(check, kv_cache, slots, latent, rope, scale_inv, stream);
}

void gather_cache(const TensorView& kv_cache, const TensorView& slots, const TensorView& out,
                  float scale, Stream stream) {
  const detail::ArgChecker check("gather_cache");
  const kernels::PagedCache cache = check_cache(check, kv_cache);
  check_slots(check, slots, kv_cache);
  check.defined(out, "out", 2);
  check.dtype(out, "out", {DType::kBFloat16});
  check.dim(out, "out", 0, slots.size(0));
  check.dim(out, "out", 1, kCacheRowDim);
  check.last_dim_contiguous(out, "out");
  check.non_overlapping(out, "out");
  check.same_device(out, "out", kv_cache.device);
  check.disjoint(out, "out", kv_cache, "kv_cache");
  check.disjoint(out, "out", slots, "slots");
  check.finite(scale, "scale");

  const detail::DeviceGuard guard(kv_cache.device, check.function());
  check_slot_values(check.function(), slots, cache, stream);
  if (!kv_cache.is_cuda()) return reference::gather_cache(kv_cache, slots, out, scale);
  kernels::run_gather_cache({.cache = cache,
                             .slots = slots.ptr<const int64_t>(),
                             .slot_stride = slots.stride(0),
                             .out = out.data,
                             .out_stride = out.stride(0),
                             .num_rows = slots.size(0),
                             .scale = scale},
                            stream);
  detail::check_cuda(cudaGetLastError(), "gather_cache", "kernel launch");
}

}  // namespace speedmla
