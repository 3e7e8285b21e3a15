#include "kernels/decode/sm90/launch.h"

#include "kernels/decode/sm90/combine.h"
#include "kernels/decode/sm90/schedule.h"

namespace speedmla::kernels::decode_sm90 {

cudaError_t run_decode(const CUtensorMap& kv_map, const DecodeParams& params, bool fp8, cudaStream_t stream) {
  run_decode_schedule(params, stream);
  if (fp8) launch_decode_fp8(kv_map, params, stream);
  else launch_decode_bf16(kv_map, params, stream);
  if (params.num_slots > 0) run_decode_combine(params, stream);
  return cudaGetLastError();
}

}  // namespace speedmla::kernels::decode_sm90
