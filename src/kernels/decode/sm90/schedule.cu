#include "kernels/decode/sm90/plan.cuh"
#include "kernels/sm90/dependent_launch.cuh"
#include "kernels/decode/sm90/schedule.h"

namespace speedmla::kernels::decode_sm90 {
namespace {

constexpr int kScheduleThreads = 1024;
// Part sizes weighed by the plan: the even split and the kCandidates - 1 next ones in steps of
// max(1, even / kCandidateSpan), so up to an eighth larger for long parts and up to 31 units
// larger for short ones (where fewer, longer parts may pay: the cost model decides).
constexpr int kCandidates = 32;
constexpr int kCandidateSpan = 8 * kCandidates;  // step = even split / kCandidateSpan
// Batches up to this size keep their requests' first units in shared memory (16 KB) while the
// plan weighs part sizes; larger ones read them back from p.plans.
constexpr int kStagedRequests = 4096;

// Exclusive prefix sum of one value per thread across the CTA; returns the thread's offset
// and stores the CTA total in *total. T: int, or long long for two counts scanned at once.
template <typename T>
__device__ T block_exclusive_scan(T value, T* total) {
  __shared__ T warp_totals[kScheduleThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inclusive = value;
  for (int delta = 1; delta < 32; delta *= 2) {
    const T other = __shfl_up_sync(0xffffffffu, inclusive, delta);
    if (lane >= delta) inclusive += other;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    T warp_sum = lane < kScheduleThreads / 32 ? warp_totals[lane] : 0;
    for (int delta = 1; delta < 32; delta *= 2) {
      const T other = __shfl_up_sync(0xffffffffu, warp_sum, delta);
      if (lane >= delta) warp_sum += other;
    }
    warp_totals[lane] = warp_sum;  // inclusive over warps
  }
  __syncthreads();
  const T warp_offset = warp > 0 ? warp_totals[warp - 1] : 0;
  *total = warp_totals[kScheduleThreads / 32 - 1];
  __syncthreads();  // warp_totals is reused by the next scan
  return warp_offset + inclusive - value;
}

// Units per part. Cutting the unit sequence evenly over the parts balances them best but cuts
// requests wherever a boundary falls, and every cut costs two partial results: written by the
// main kernel, read back by the combine kernel (at 64 rows and B = 128, cutting nearly every
// request made the operation 10-15% slower than whole requests per part). So the plan weighs
// part sizes from the even split up (kCandidates), each by its longest part plus what its
// cuts cost (p.slot_cost_blocks per slot, two per boundary inside a request), and takes the
// cheapest. A batch of equal lengths then gets whole requests per part, and a mixed batch
// the even split unless boundaries can cheaply move to requests' starts.
// A boundary k * units lies inside a request unless some request starts there, so a size's
// cuts are its boundaries less the requests whose first unit it divides. Warp c weighs
// candidate c; then every warp finds the cheapest itself (no second CTA barrier). This kernel
// is on the operation's critical path: counting per thread over its own requests, 32
// candidates each, took it from 5 to 19 us on the H200.
__device__ int choose_units_per_part(const DecodeParams& p, int total_units, const int* staged_first_units) {
  static_assert(kCandidates == 32 && kScheduleThreads / 32 == kCandidates, "one warp per candidate");
  __shared__ float cost[kCandidates];
  const int even = max(1, (total_units + p.num_parts - 1) / p.num_parts);
  const int step = max(1, even / kCandidateSpan);
  const int lane = threadIdx.x % 32, candidate = threadIdx.x / 32;
  const int units = even + candidate * step;
  int aligned = 0;  // requests after the first that start on a boundary
  for (int b = 1 + lane; b < p.batch; b += 32) {
    const int first_unit = staged_first_units != nullptr ? staged_first_units[b] : p.plans[b].first_unit;
    aligned += first_unit % units == 0 ? 1 : 0;
  }
  for (int d = 16; d > 0; d /= 2) aligned += __shfl_xor_sync(0xffffffffu, aligned, d);
  if (lane == 0) {
    const int inside = (total_units + units - 1) / units - 1 - aligned;
    cost[candidate] = units + 2.f * inside * p.slot_cost_blocks;
  }
  __syncthreads();
  // The cheapest candidate, the smallest of equals.
  float best_cost = cost[lane];
  int best = lane;
  for (int d = 16; d > 0; d /= 2) {
    const float other_cost = __shfl_xor_sync(0xffffffffu, best_cost, d);
    const int other = __shfl_xor_sync(0xffffffffu, best, d);
    if (other_cost < best_cost || (other_cost == best_cost && other < best)) {
      best_cost = other_cost;
      best = other;
    }
  }
  return even + best * step;
}

// Units request b takes in the unit sequence. The balanced policy: its blocks (at least one,
// so that some CTA writes an empty request's output). The batch-invariant policy rounds that
// up to a multiple of split_units, so that every request starts on a piece boundary and is cut
// at multiples of split_units blocks from its own start: where it is cut then depends on its
// length alone, never on the requests before it. (The padding is never walked: a piece ends
// where its request's blocks end.)
__device__ __forceinline__ int planned_units(const DecodeParams& p, int num_blocks) {
  const int units = request_units(num_blocks);
  return p.split_units > 0 ? (units + p.split_units - 1) / p.split_units * p.split_units : units;
}

// Each thread owns a contiguous run of requests; a scan gives every request its first unit,
// a second (once the part size is chosen) its first partial-result slot. Each request then
// names itself the first request of the parts that start inside it: every part with work
// starts inside exactly one request, and no thread has to search for it.
// Launched in plain stream order (the previous operation's kernels may still read the plan
// it rewrites), it lets the main kernel launch at once: that kernel's set-up overlaps this one.
__global__ void __launch_bounds__(kScheduleThreads) decode_schedule_kernel(DecodeParams p) {
  sm90::allow_dependent_launch();
  // The main and combine kernels' completion counters start at zero (slot_handover.cuh; the
  // combine leaves them zero too, for operations that reuse this plan).
  for (int i = threadIdx.x; i < p.num_slots; i += kScheduleThreads) p.slot_writers[i] = 0;
  for (int i = threadIdx.x; i < p.max_split_requests; i += kScheduleThreads) p.combine_finished[i] = 0;
  const int per_thread = (p.batch + kScheduleThreads - 1) / kScheduleThreads;
  const int begin = min(p.batch, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(p.batch, begin + per_thread);

  int my_units = 0;
  for (int b = begin; b < end; ++b) my_units += planned_units(p, request_num_blocks(p, p.seq_lens[b]));
  int total_units = 0;
  const int unit_offset = block_exclusive_scan(my_units, &total_units);
  int units_per_part, piece_units;
  if (p.split_units > 0) {
    // Batch-invariant: whole pieces per part, as evenly as whole pieces go. Which part computes
    // a piece changes nothing in its result.
    const int pieces = total_units / p.split_units;
    units_per_part = (pieces + p.num_parts - 1) / p.num_parts * p.split_units;
    piece_units = p.split_units;
  } else {
    __shared__ int staged_first_units[kStagedRequests];
    int* staged = p.batch <= kStagedRequests ? staged_first_units : nullptr;
    for (int b = begin, unit = unit_offset; b < end; ++b) {
      if (staged != nullptr) staged[b] = unit;
      else p.plans[b].first_unit = unit;
      unit += request_units(request_num_blocks(p, p.seq_lens[b]));
    }
    __syncthreads();  // first units are visible to the whole CTA from here
    units_per_part = choose_units_per_part(p, total_units, staged);
    piece_units = units_per_part;
  }

  // The thread's plans, all but the slot; requests cut into several pieces need one slot per
  // piece.
  auto plan_of = [&](int b, int unit) {
    RequestPlan plan;
    plan.first_unit = unit;
    plan.num_blocks = request_num_blocks(p, p.seq_lens[b]);
    plan.first_piece = unit / piece_units;
    plan.split_slot = -1;
    return plan;
  };
  // One scan counts both the slots (low 32 bits) and the split requests (high 32 bits) before
  // the thread's: where its requests' slots and combine work-list entries go.
  constexpr long long kOneSplit = 1ll << 32;
  long long my_slots = 0;
  for (int b = begin, unit = unit_offset; b < end; ++b) {
    const RequestPlan plan = plan_of(b, unit);
    const int splits = request_num_splits(plan, piece_units);
    my_slots += splits > 1 ? kOneSplit + splits : 0;
    unit += planned_units(p, plan.num_blocks);
  }
  long long total_slots = 0;
  const long long slots_before = block_exclusive_scan(my_slots, &total_slots);
  int slot = static_cast<int>(slots_before & 0xffffffffll);
  int split_index = static_cast<int>(slots_before >> 32);

  for (int b = begin, unit = unit_offset; b < end; ++b) {
    RequestPlan plan = plan_of(b, unit);
    const int splits = request_num_splits(plan, piece_units);
    if (splits > 1) {
      plan.split_slot = slot;
      p.split_requests[split_index++] = SplitRequest{b, slot, splits};
      slot += splits;
    }
    p.plans[b] = plan;
    // Parts whose first unit lies in [unit, unit + units) (none starts in the invariant
    // policy's padding: it lies inside the request's last piece).
    const int units = request_units(plan.num_blocks);
    for (int part = (unit + units_per_part - 1) / units_per_part; part <= (unit + units - 1) / units_per_part; ++part)
      p.part_first_request[part] = b;
    unit += planned_units(p, plan.num_blocks);
  }
  if (threadIdx.x == 0)
    *p.plan_header = PlanHeader{total_units, units_per_part, piece_units, static_cast<int>(total_slots >> 32)};
}

}  // namespace

void run_decode_schedule(const DecodeParams& params, cudaStream_t stream) {
  decode_schedule_kernel<<<1, kScheduleThreads, 0, stream>>>(params);
}

}  // namespace speedmla::kernels::decode_sm90
