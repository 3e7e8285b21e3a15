// The check mode's validation rules (speedmla/check.h), one inline function per value kind,
// shared by the GPU kernels (value_checks.cu) and their CPU twins (value_checks_host.cpp) so the
// two cannot disagree. Each returns the DeviceCheckFlag bits one element raises (0 when good).
#pragma once

#include <cstdint>

#include "kernels/backend/page_table.h"  // SPEEDMLA_HOST_DEVICE
#include "speedmla/check.h"
#include "speedmla/tensor.h"

namespace speedmla::kernels {

// mla_decode: request b's seq_len, and the page ids it reads.
struct DecodeValuesCheck {
  const int32_t* seq_lens;     // [batch]
  const int32_t* block_table;  // [batch, max_pages], rows block_table_stride apart
  int64_t block_table_stride;
  int64_t batch, max_pages, page_size, num_pages, q_len;
};

SPEEDMLA_HOST_DEVICE inline uint32_t decode_request_flags(const DecodeValuesCheck& p, int64_t b) {
  const int64_t seq_len = p.seq_lens[b];
  if (seq_len < 0 || seq_len > p.max_pages * p.page_size) return kCheckDecodeSeqLen;
  uint32_t flags = seq_len < p.q_len ? kCheckDecodeShortSeq : 0u;
  const int64_t pages = (seq_len + p.page_size - 1) / p.page_size;
  for (int64_t i = 0; i < pages; ++i) {
    const int64_t page = p.block_table[b * p.block_table_stride + i];
    if (page < 0 || page >= p.num_pages) flags |= kCheckDecodePageId;
  }
  return flags;
}

// mla_prefill: one cu_seqlens array of `entries` (B + 1) values over `rows` packed rows.
struct CuSeqlensCheck {
  const int32_t* cu_seqlens;
  int64_t entries, rows;
};

SPEEDMLA_HOST_DEVICE inline uint32_t cu_seqlens_entry_flags(const CuSeqlensCheck& p, int64_t i) {
  const int64_t value = p.cu_seqlens[i];
  const bool bad = (i == 0 && value != 0) || (i > 0 && value < p.cu_seqlens[i - 1]) || value > p.rows;
  return bad ? kCheckPrefillCuSeqlens : 0u;
}

// kv_cache_write / gather_cache: one slot.
struct SlotsCheck {
  const int64_t* slots;
  int64_t stride, count, num_slots;
};

SPEEDMLA_HOST_DEVICE inline uint32_t slot_flags(const SlotsCheck& p, int64_t i) {
  return p.slots[i * p.stride] >= p.num_slots ? kCheckCacheSlot : 0u;
}

// MlaBackend: the pool indices of the first `rows` batch rows.
struct PoolIndicesCheck {
  PageTable pages;
  int64_t rows;
};

SPEEDMLA_HOST_DEVICE inline uint32_t pool_index_flags(const PoolIndicesCheck& p, int64_t r) {
  return p.pages.pool_row(r) < 0 ? kCheckPoolIndex : 0u;
}

// Launch the validation kernel of each kind on `stream` (one thread per element; nothing when
// there are none); flags are OR-ed into the device's flag word.
void run_check_decode_values(const DecodeValuesCheck& params, Stream stream);
void run_check_cu_seqlens(const CuSeqlensCheck& params, Stream stream);
void run_check_slots(const SlotsCheck& params, Stream stream);
void run_check_pool_indices(const PoolIndicesCheck& params, Stream stream);
// The device's flag word: read and clear it, after waiting for `stream` (current device).
// Returns a cudaError_t.
int take_device_flags(uint32_t* flags, Stream stream);

// CPU twins: the same rules, OR-ed into the host's flag word.
void check_decode_values_on_host(const DecodeValuesCheck& params);
void check_cu_seqlens_on_host(const CuSeqlensCheck& params);
void check_slots_on_host(const SlotsCheck& params);
void check_pool_indices_on_host(const PoolIndicesCheck& params);
uint32_t take_host_flags();

}  // namespace speedmla::kernels
