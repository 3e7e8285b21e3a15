// speedmla/check.h — the device-side check mode: reports bad values that live on the device.
//
// Some arguments are read only on the device (decode seq_lens and block tables, prefill
// cu_seqlens, cache slots, the backend's pool indices): checking them on the host would need a
// synchronisation, which CUDA graphs and the engine's pipelining forbid. The kernels make such
// values harmless (docs/device-values.md says what each op does with each one), but silently.
// With the check mode on, every such call also launches a small validation kernel on the same
// stream, before the operation, that raises a flag in device memory for each kind of bad value
// it finds; the operation itself runs unchanged. Off (the default), nothing is launched and the
// hot path is the same code as without this header. The validation kernels allocate nothing and
// never synchronise, so they are captured into CUDA graphs along with the operation and check
// every replay's values. CPU tensors are checked the same way into a host-side flag set.
#pragma once

#include <cstdint>
#include <string>

#include "speedmla/tensor.h"

namespace speedmla {

// One bit per kind of bad device-side value.
enum DeviceCheckFlag : uint32_t {
  kCheckDecodeSeqLen = 1u << 0,     // mla_decode: a seq_lens[b] < 0 or > max_pages * page_size
  kCheckDecodePageId = 1u << 1,     // mla_decode: a page id a request reads (its first
                                    //   ceil(seq_len / page_size) entries) outside [0, num_pages)
  kCheckDecodeShortSeq = 1u << 2,   // mla_decode: a valid seq_lens[b] < q_len (some query rows
                                    //   see no key: out 0, lse -inf; legal, but rarely meant)
  kCheckPrefillCuSeqlens = 1u << 3, // mla_prefill: cu_seqlens_q/k[0] != 0, a decrease, or a last
                                    //   entry past the rows of q (k)
  kCheckCacheSlot = 1u << 4,        // kv_cache_write / gather_cache: a slot >= num_pages * page_size
                                    //   (negative slots are padding, not errors)
  kCheckPoolIndex = 1u << 5,        // MlaBackend: a req_pool_indices entry outside [0, pool_size)
};

// Turns the check mode on or off for the whole process (all devices and threads). Its initial
// state is on when the environment variable SPEEDMLA_CHECK is "1" at the first call of any
// operation, off otherwise.
void set_device_checks(bool enabled);
bool device_checks_enabled();

// Returns the flags raised on `device` since the last call (a bitwise OR of DeviceCheckFlag) and
// clears them. For a CUDA device it waits for `stream` (the work queued on it, validation
// kernels included, finishes first) and reads 4 bytes: not for use inside CUDA-graph capture.
// Flags are per device, not per stream or call: read them where the engine can afford a sync
// (after a step, in a test, in a debug build). For the CPU it reads the host-side flags.
// Throws Error for a CUDA error or a device index out of range.
uint32_t take_device_check_flags(Device device, Stream stream = nullptr);

// "decode seq_len, prefill cu_seqlens" for a set of flags; "none" for 0.
std::string describe_device_check_flags(uint32_t flags);

}  // namespace speedmla
