// CPU twins of the check mode's validation kernels (value_checks.h).
#include <atomic>

#include "kernels/check/value_checks.h"

namespace speedmla::kernels {
namespace {

std::atomic<uint32_t> host_flags{0};

void raise(uint32_t flags) {
  if (flags) host_flags.fetch_or(flags, std::memory_order_relaxed);
}

}  // namespace

void check_decode_values_on_host(const DecodeValuesCheck& p) {
  for (int64_t b = 0; b < p.batch; ++b) raise(decode_request_flags(p, b));
}
void check_cu_seqlens_on_host(const CuSeqlensCheck& p) {
  for (int64_t i = 0; i < p.entries; ++i) raise(cu_seqlens_entry_flags(p, i));
}
void check_slots_on_host(const SlotsCheck& p) {
  for (int64_t i = 0; i < p.count; ++i) raise(slot_flags(p, i));
}
void check_pool_indices_on_host(const PoolIndicesCheck& p) {
  for (int64_t r = 0; r < p.rows; ++r) raise(pool_index_flags(p, r));
}
uint32_t take_host_flags() { return host_flags.exchange(0, std::memory_order_relaxed); }

}  // namespace speedmla::kernels
