// The decode scratch of one MlaBackend: a buffer per stream for eager calls, one for CUDA graphs.
//
// Decode needs split-KV scratch (plans, partial results) and, with an FP8 cache, room to
// quantise the queries. Work queued on different streams may run at the same time, so one
// buffer shared by two streams would let two batches (or a target and its draft model on a side
// stream) overwrite each other's plans. Each backend instance therefore owns its buffers
// (a draft backend has its own) and keys eager calls' buffers by stream. Calls made while the
// metadata comes from a CUDA-graph capture or replay use one buffer shared by the backend's
// graphs: they replay one at a time on the engine's stream, and a capture stream (usually a
// fresh side stream) would otherwise have no buffer to capture. Buffers only grow; growing
// allocates, which capture cannot record. Not thread-safe, like MlaBackend itself.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "backend/device_buffer.h"
#include "speedmla/tensor.h"

namespace speedmla::detail {

// A buffer that only grows. A replaced buffer stays allocated until this one is destroyed:
// CUDA graphs captured while it was current still point at it, and work queued before the
// growth may still use it.
class GrowingBuffer {
 public:
  // A [capacity] uint8 view, first replaced by one of `grow_to` (>= bytes) bytes when the
  // capacity is below `bytes`. Throws Error naming `caller` if it must grow while `stream` is
  // being captured, or if allocation fails.
  TensorView acquire(Device device, size_t bytes, size_t grow_to, Stream stream, const char* caller);
  size_t capacity() const { return current_ ? current_->size() : 0; }

 private:
  std::unique_ptr<DeviceBuffer> current_;
  std::vector<std::unique_ptr<DeviceBuffer>> retired_;
};

class BackendWorkspaces {
 public:
  explicit BackendWorkspaces(Device device) : device_(device) {}
  Device device() const { return device_; }

  // The buffer of eager calls on `stream`; a stream's first call finds it empty. Streams are told
  // apart by their handle: a new stream that reuses a destroyed one's handle inherits its buffer,
  // which is safe once the old stream's work is done.
  GrowingBuffer& of_stream(Stream stream);
  // The buffer of calls whose metadata comes from a graph capture or replay.
  GrowingBuffer& of_graphs() { return graphs_; }

  size_t stream_capacity(Stream stream) const;  // 0 before the stream's first call
  size_t graph_capacity() const { return graphs_.capacity(); }

 private:
  Device device_;
  // Few streams per backend (one or two): a vector searched front to back, no map, no lock.
  std::vector<std::pair<Stream, GrowingBuffer>> streams_;
  GrowingBuffer graphs_;
};

}  // namespace speedmla::detail
