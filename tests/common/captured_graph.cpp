#include "common/captured_graph.h"

namespace speedmla::test {

CapturedGraph::CapturedGraph() { cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }

CapturedGraph::~CapturedGraph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void CapturedGraph::finish_capture() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
  exec_ = nullptr;
  graph_ = nullptr;
  ended_ = cudaStreamEndCapture(stream_, &graph_);
  if (ended_ == cudaSuccess) ended_ = cudaGraphInstantiate(&exec_, graph_, 0);
}

cudaError_t CapturedGraph::replay() {
  if (exec_ == nullptr) return cudaErrorInvalidValue;
  const cudaError_t launched = cudaGraphLaunch(exec_, stream_);
  return launched != cudaSuccess ? launched : cudaStreamSynchronize(stream_);
}

}  // namespace speedmla::test
