#include "kernels/decode/sm90/launch.h"

#include "kernels/decode/sm90/combine.h"
#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/schedule.h"

namespace speedmla::kernels::decode_sm90 {

DecodeLaunchStatus run_decode(const DecodeLaunch& launch, cudaStream_t stream, DecodeSteps steps) {
  if (steps == DecodeSteps::kPlan) {
    run_decode_schedule(make_decode_params(launch), stream);
    return DecodeLaunchStatus{0, cudaGetLastError()};
  }
  // Without its opt-in the main kernel would not run while the schedule and combine kernels
  // would, leaving a wrong output and no error: the map and the opt-in come before any launch.
  using Prepare = DecodeLaunchStatus (*)(const DecodeLaunch&, CUtensorMap*);
  using Launch = cudaError_t (*)(const CUtensorMap&, const DecodeParams&, cudaStream_t);
  const bool copied_rows = launch.page_size < min_tma_page_tokens(launch.fp8);
  // FP8 requests of at most 32 query rows: the narrow kernel, which puts the rows in the wgmma's
  // N rather than padding them to its M of 64 (config.h).
  const int narrow = narrow_tile_rows(launch.fp8, launch.page_size, int64_t{launch.num_heads} * launch.q_len);
  struct MainKernel {
    Prepare prepare;
    Launch launch;
  };
  const MainKernel main_kernel =
      narrow == 16  ? MainKernel{prepare_decode_fp8_narrow16, launch_decode_fp8_narrow16}
      : narrow == 32 ? MainKernel{prepare_decode_fp8_narrow32, launch_decode_fp8_narrow32}
      : launch.fp8   ? (copied_rows ? MainKernel{prepare_decode_fp8_copied_rows, launch_decode_fp8_copied_rows}
                                    : MainKernel{prepare_decode_fp8, launch_decode_fp8})
                     : (copied_rows ? MainKernel{prepare_decode_bf16_copied_rows, launch_decode_bf16_copied_rows}
                                    : MainKernel{prepare_decode_bf16, launch_decode_bf16});
  CUtensorMap kv_map;
  DecodeLaunchStatus status = main_kernel.prepare(launch, &kv_map);
  if (status.tensor_map != 0 || status.cuda != cudaSuccess) {
    cudaGetLastError();  // a failed runtime call also set the thread's last error: reported here instead
    return status;
  }
  const DecodeParams params = make_decode_params(launch);
  if (steps == DecodeSteps::kAll) run_decode_schedule(params, stream);
  status.cuda = main_kernel.launch(kv_map, params, stream);
  if (status.cuda != cudaSuccess) return status;
  if (params.num_slots > 0) run_decode_combine(params, stream);
  status.cuda = cudaGetLastError();
  return status;
}

}  // namespace speedmla::kernels::decode_sm90
