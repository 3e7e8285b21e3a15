// The fuzz loop shared by the CPU and GPU fuzz tests (tests/cpu/fuzz_test.cpp,
// tests/gpu/fuzz_gpu_test.cpp): `cases` random argument sets of one operation, each judged by
// fuzz::run_case; one gtest failure per broken case (the first few spelled out), and a check that
// the cases exercised both outcomes, so that a generator which only ever breaks calls, or never
// does, fails instead of passing vacuously.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "common/fuzz.h"

namespace speedmla::test::fuzz {

inline void run_fuzz(Op op, Target target, int cases) {
  std::mt19937_64 rng = case_rng(std::string("fuzz/") + op_name(op) + (target == Target::kGpu ? "/gpu" : "/cpu"));
  int refused = 0, matched = 0, failed = 0;
  for (int i = 0; i < cases; ++i) {
    const Case c = make_case(op, rng, target);
    const Result r = run_case(c, target);
    (r.outcome == Outcome::kRefused ? refused : matched) += 1;
    if (r.failure.empty()) continue;
    if (++failed <= 8) ADD_FAILURE() << "case " << i << ": " << r.failure << "\n  " << c.describe()
                                     << (r.message.empty() ? "" : "\n  message: " + r.message);
  }
  EXPECT_EQ(failed, 0) << "cases that broke the rule (the first 8 above; SPEEDMLA_TEST_SEED replays them)";
  std::printf("[   fuzz   ] %s on the %s: %d cases, %d refused, %d accepted and checked\n", op_name(op),
              target == Target::kGpu ? "GPU" : "CPU", cases, refused, matched);
  EXPECT_GE(refused, cases / 10) << "too few refused cases: the mutations no longer break calls";
  EXPECT_GE(matched, cases / 10) << "too few accepted cases: the base cases are not valid";
}

}  // namespace speedmla::test::fuzz
