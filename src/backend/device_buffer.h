// An owning byte buffer on the CPU or a CUDA device: the backend's metadata tables, chunk lists
// and workspaces. Allocation and release happen only here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "speedmla/tensor.h"

namespace speedmla::detail {

class DeviceBuffer {
 public:
  enum class Fill : uint8_t { kUninitialized, kZero };

  // 256-byte aligned. Zero-filling a CUDA buffer completes before the constructor returns.
  // Throws Error (naming `caller`) if allocation fails.
  DeviceBuffer(Device device, size_t bytes, Fill fill, const char* caller);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  Device device() const { return device_; }
  size_t size() const { return bytes_; }
  void* data() const { return data_; }

  // A contiguous view of `shape` starting `byte_offset` bytes in; the caller keeps it in bounds.
  TensorView view(DType dtype, std::initializer_list<int64_t> shape, size_t byte_offset = 0) const;

  // Copies `bytes` host bytes to `byte_offset`: memcpy on the CPU, an asynchronous copy on
  // `stream` for CUDA (from pageable memory, so `host` may be reused as soon as this returns).
  void upload(size_t byte_offset, const void* host, size_t bytes, Stream stream,
              const char* caller) const;

 private:
  Device device_;
  size_t bytes_ = 0;
  void* data_ = nullptr;
};

}  // namespace speedmla::detail
