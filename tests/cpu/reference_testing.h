// Helpers of the reference tests: the textbook attention formula (written independently of
// src/reference), seeded random generators and an element checker that reports a few failures
// rather than thousands.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace speedmla::test {

inline constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// A generator with a fresh seed, printed so that a failure can be replayed.
inline std::mt19937_64 seeded_rng() {
  const uint64_t seed = std::random_device{}() * 0x100000001ull ^ std::random_device{}();
  std::cout << "seed " << seed << "\n";
  return std::mt19937_64(seed);
}

struct NaiveAttention {
  std::vector<double> out;
  double lse = kNegInf;
};

// out = output_scale * sum_j exp(s_j) v_j / sum_j exp(s_j) with s_j = softmax_scale * q·k_j, and
// lse = ln(sum_j exp(s_j)), straight from the definition in long double (no max subtraction:
// the tests keep scores small). No keys: out 0, lse -inf.
inline NaiveAttention naive_attention(const std::vector<double>& q,
                                      const std::vector<std::vector<double>>& keys,
                                      const std::vector<std::vector<double>>& values,
                                      double softmax_scale, double output_scale, size_t d_v) {
  NaiveAttention result;
  result.out.assign(d_v, 0.0);
  if (keys.empty()) return result;
  long double sum = 0;
  std::vector<long double> weighted(d_v, 0);
  for (size_t j = 0; j < keys.size(); ++j) {
    long double dot = 0;
    for (size_t d = 0; d < q.size(); ++d) dot += static_cast<long double>(q[d]) * keys[j][d];
    const long double e = std::exp(softmax_scale * dot);
    sum += e;
    for (size_t d = 0; d < d_v; ++d) weighted[d] += e * values[j][d];
  }
  for (size_t d = 0; d < d_v; ++d) result.out[d] = static_cast<double>(output_scale * weighted[d] / sum);
  result.lse = static_cast<double>(std::log(sum));
  return result;
}

// Checks elements one by one; reports the first few mismatches and the total.
class ElementChecker {
 public:
  ~ElementChecker() {
    if (failures_ > kReported) ADD_FAILURE() << failures_ << " mismatched elements in all";
  }
  // `actual` is `expected` rounded once to BF16 (half an ulp: 2^-9 relative) give or take the
  // difference between two FP64-accurate computations.
  void bf16(double actual, double expected, const char* what, std::initializer_list<int64_t> at) {
    check(std::abs(actual - expected) <= 0x1p-8 * std::abs(expected) + 1e-12, actual, expected,
          what, at);
  }
  // An FP32 result of an FP64-accurate computation.
  void fp32(double actual, double expected, const char* what, std::initializer_list<int64_t> at) {
    check(actual == expected || std::abs(actual - expected) <= 1e-6 * std::max(1.0, std::abs(expected)),
          actual, expected, what, at);
  }
  // Equal values (+0 == -0), or both NaN.
  void same(double actual, double expected, const char* what, std::initializer_list<int64_t> at) {
    check(actual == expected || (std::isnan(actual) && std::isnan(expected)), actual, expected,
          what, at);
  }
  // Any other condition on an element.
  void check(bool ok, double actual, double expected, const char* what,
             std::initializer_list<int64_t> at) {
    if (ok || ++failures_ > kReported) return;
    std::ostringstream where;
    const char* separator = "";
    for (int64_t i : at) {
      where << separator << i;
      separator = ",";
    }
    ADD_FAILURE() << what << "[" << where.str() << "] = " << actual << ", expected " << expected;
  }

 private:
  static constexpr int kReported = 8;
  int failures_ = 0;
};

}  // namespace speedmla::test
