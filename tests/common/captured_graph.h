// A CUDA graph captured on a stream of its own, for the GPU tests that check that an operation
// is capturable and that replays with new inputs stay correct.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "speedmla/speedmla.h"

namespace speedmla::test {

// Owns a non-blocking stream and the graph captured on it (global capture mode); both are
// destroyed with the object, also when an assertion ends the test early.
class CapturedGraph {
 public:
  CapturedGraph();
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  cudaStream_t stream() const { return stream_; }
  Stream handle() const { return reinterpret_cast<Stream>(stream_); }

  // Records what `calls()` enqueues on stream() and instantiates it. The capture is ended even
  // when `calls` throws speedmla::Error (a capture left open would fail every later test); the
  // error's message is returned then, "" otherwise. `ended` (see ended()) is the status of
  // ending the capture and instantiating the graph.
  template <typename Calls>
  std::string capture(Calls&& calls) {
    std::string refused;
    ended_ = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal);
    if (ended_ != cudaSuccess) return refused;
    try {
      std::forward<Calls>(calls)();
    } catch (const Error& error) {
      refused = error.what();
    }
    finish_capture();
    return refused;
  }
  // cudaSuccess when the last capture ended and its graph was instantiated.
  cudaError_t ended() const { return ended_; }
  // Launches the instantiated graph on stream() and waits for it.
  cudaError_t replay();

 private:
  void finish_capture();
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaError_t ended_ = cudaErrorNotReady;
};

}  // namespace speedmla::test
