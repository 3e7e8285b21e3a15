// Hand-over of split requests' partial results from the main kernel to the combine kernel
// while the main kernel still runs (params.h: slot_writers, combine_finished).
//
// The combine is launched as a programmatic dependent of the main kernel, whose CTAs allow it
// right after their own grid_dependency_wait: its CTAs start as the main kernel's leave their
// SMs (the main kernel's CTAs take whole SMs). Waiting for the whole main grid there left the
// combine's loads, merges and stores after the last main CTA's end (B = 4, s_k 80K, H = 16,
// q4: 6-7 % of the call). Instead each consumer warp of the main kernel counts itself into its
// slot's counter once its rows are written, and the combine merges each piece as soon as its
// count is complete: pieces finished early are merged during the main kernel's tail. (H200,
// 2026-12-04, µs a call runs past the main kernel's end, before -> now: B = 4 s_k 80K H = 16 q4
// BF16 7.2 -> 3.1, FP8 5.7 -> 3.2; H = 32 6.3 -> 3.2, 5.5 -> 3.3; B = 16 H = 16 10.0 -> 6.4,
// 7.7 -> 6.5. Its cost: a call whose pieces all end together gains nothing and pays the polls
// and the count at the end, B = 1 s_k 128K H = 128 FP8 0.066 -> 0.068 ms.)
//
// Why the combine may start before the main grid completes: it reads the plan (complete: every
// main CTA has passed its wait for the schedule kernel before the combine can launch), counted
// slots (complete by the count), and writes only split requests' rows of out and lse, which no
// main CTA writes. It still waits for the main grid before it exits, so that work after it
// that waits for it (grid_dependency_wait, or plain stream order) sees the whole operation.
// No deadlock: the combine launches only once every main CTA has started (each allows it), so
// every count it waits for is being made by a running CTA.
#pragma once

#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/params.h"
#include "kernels/sm90/dependent_launch.cuh"

namespace speedmla::kernels::decode_sm90 {

// Main kernel, every consumer warp of every row tile, after its last store of the slot's rows
// (partial out and LSE). The warp barrier orders the other lanes' stores before lane 0's
// release. One counter per slot, not per (slot, row tile): its address then costs the
// register-tight FP8 consumer nothing (one per row tile spilled 12 bytes), and a request's row
// tiles run side by side, so they finish a piece at about the same time.
__device__ __forceinline__ void count_slot_writer(const DecodeParams& p, int slot) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) sm90::add_release(p.slot_writers + slot, 1);
}

// Combine kernel, a whole warp: returns once every consumer warp of every row tile of the main
// kernel has written slots first, first + stride, ... (`count` of them, at most 32), and their
// stores are visible to the warp. Lane i polls slot first + i * stride, so that a round of
// pieces waits one memory round trip, not one per piece (polled one after another, the acquire
// loads made a B = 1 request of 66 pieces 3 us slower); the warp barrier passes each lane's
// acquire on to the whole warp.
__device__ __forceinline__ void wait_slots_written(const DecodeParams& p, int first, int stride, int count) {
  const int lane = threadIdx.x % 32;
  const int writers = kSlotWriterWarps * p.num_row_tiles;
  const int* counter = p.slot_writers + first + lane * stride;
  while (!__all_sync(0xffffffffu, lane >= count || sm90::load_acquire(counter) >= writers)) __nanosleep(64);
  __syncwarp();
}

// Combine kernel, every thread of the CTA, once it is done with split request `index` (every
// warp past its waits): counts the CTA out; the last of the gridDim.x CTAs that merge the
// request's rows zeroes its counters for the next operation.
__device__ __forceinline__ void finish_split_request(const DecodeParams& p, const SplitRequest& split, int index) {
  __syncthreads();
  if (threadIdx.x >= 32) return;
  int finished = 0;
  if (threadIdx.x == 0) finished = sm90::fetch_add_acq_rel(&p.combine_finished[index], 1) + 1;
  if (__shfl_sync(0xffffffffu, finished, 0) != static_cast<int>(gridDim.x)) return;
  __syncwarp();  // the zeroes follow lane 0's acquire
  for (int i = threadIdx.x; i < split.num_splits; i += 32) p.slot_writers[split.slot + i] = 0;
  if (threadIdx.x == 0) p.combine_finished[index] = 0;
}

}  // namespace speedmla::kernels::decode_sm90
