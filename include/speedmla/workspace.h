// speedmla/workspace.h — one scratch buffer per device, shared by every backend on it.
//
// Decode needs split-KV scratch (and, for an FP8 cache, room to quantise the queries). All layers
// and backends of a process run one after another on a device, so one buffer per device serves
// them all; it is sized for the largest request seen and only ever grows.
#pragma once

#include <cstddef>

#include "speedmla/tensor.h"

namespace speedmla {

// A [capacity] uint8 view of the workspace of `device`, first grown to at least `bytes` when it
// is smaller. CUDA buffers are 256-byte aligned and uninitialised; the CPU one is host memory.
// Growing allocates, which a CUDA graph cannot capture: if `stream` is capturing and the buffer
// is too small, throws Error naming `caller` instead. A buffer replaced by a larger one stays
// allocated until the process exits, because graphs captured earlier still point at it.
// Thread-safe. Throws Error if allocation fails.
TensorView acquire_workspace(Device device, size_t bytes, Stream stream, const char* caller);

// Current size in bytes of the workspace of `device` (0 before the first acquire_workspace).
size_t workspace_capacity(Device device);

}  // namespace speedmla
