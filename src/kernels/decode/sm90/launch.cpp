#include "kernels/decode/sm90/launch.h"

#include "kernels/decode/sm90/combine.h"
#include "kernels/decode/sm90/schedule.h"

namespace speedmla::kernels::decode_sm90 {

cudaError_t run_decode(const CUtensorMap& kv_map, const DecodeParams& params, bool fp8, cudaStream_t stream) {
  // Without its opt-in the main kernel would not run while the schedule and combine kernels
  // would, leaving a wrong output and no error: check it before launching anything.
  if (const cudaError_t status = fp8 ? prepare_decode_fp8() : prepare_decode_bf16(); status != cudaSuccess) {
    cudaGetLastError();  // the failed call also set the thread's last error: the caller gets it here instead
    return status;
  }
  run_decode_schedule(params, stream);
  const cudaError_t main = fp8 ? launch_decode_fp8(kv_map, params, stream) : launch_decode_bf16(kv_map, params, stream);
  if (main != cudaSuccess) return main;
  if (params.num_slots > 0) run_decode_combine(params, stream);
  return cudaGetLastError();
}

}  // namespace speedmla::kernels::decode_sm90
