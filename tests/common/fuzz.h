// Seeded fuzzing of the public operations: random small argument sets, most of them broken in
// one or two ways (dtypes, ranks, extents, strides, devices, alignment, null data, overlapping
// outputs, bad scales, out-of-range lengths, page ids, slots and cu_seqlens, NaN/inf inputs),
// each run through the public API and judged "refused with a speedmla::Error naming an argument,
// or the reference's result, never a crash".
//
// Every argument is materialised honestly: its storage is exactly what its view addresses (any
// strides, negative ones included), so a library read or write outside a view is a bug, never
// the test's. On the host that storage ends at an inaccessible page (and starts after one), so an
// overrun faults at once; on the GPU it sits between poisoned margins that are checked after
// the call (and compute-sanitizer sees the rest: scripts/gpu-check.sh --sanitize).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/util.h"

namespace speedmla::test::fuzz {

enum class Op { kDecode, kPrefill, kMerge, kCacheWrite, kGatherCache, kQuantize, kPack };
inline constexpr Op kAllOps[] = {Op::kDecode,      Op::kPrefill,  Op::kMerge, Op::kCacheWrite,
                                 Op::kGatherCache, Op::kQuantize, Op::kPack};
const char* op_name(Op op);  // the public function's name: "mla_decode", ...

enum class Role { kInput, kOutput, kInOut };

// One tensor argument of a fuzzed call, as its view will claim to be.
struct Arg {
  std::string name;
  Role role = Role::kInput;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape, strides;  // strides in elements (filled at generation)
  bool present = true;                  // an optional argument may be left out
  bool on_other_device = false;         // on the CPU while the call runs on a GPU, or vice versa
  bool null_data = false;
  int64_t misalign_bytes = 0;           // added to the data pointer
  int alias_of = -1;                    // the same view as that argument (in place)
  int inside_of = -1;                   // storage carved from that argument's storage (overlap)
  HostTensor values;                    // the logical contents, contiguous (inputs; outputs: poison)
};

struct Case {
  Op op = Op::kDecode;
  std::vector<Arg> args;
  float scale_a = 1.f, scale_b = 1.f;  // softmax/output scale, scale_inv, scale, k/v scale_inv
  bool causal = false;
  PrefillValueLayout v_layout = PrefillValueLayout::kTokenMajor;  // prefill's v, pack's v_out
  bool must_refuse = false;   // a mutation no valid call has (wrong device, overlap, ...)
  bool values_out_of_contract = false;  // device-side values the CPU path would refuse
  std::string mutations;      // what was broken, for the failure message
  std::string describe() const;
};

enum class Target { kCpu, kGpu };

// A random case of `op` for `target` (GPU cases keep to the page sizes and layouts the kernels
// take more often, so that accepted calls are common there too).
Case make_case(Op op, std::mt19937_64& rng, Target target);

enum class Outcome { kRefused, kMatched };
struct Result {
  Outcome outcome = Outcome::kRefused;
  std::string failure;  // empty unless the case failed the rule; then says how
  std::string message;  // the Error's message when refused
};

// Runs `c` on the target and judges it against the CPU path on contiguous copies.
Result run_case(const Case& c, Target target);

}  // namespace speedmla::test::fuzz
