// speedmla/numeric.h — bit-exact scalar conversions used by the CPU reference (host code).
//
// They match the GPU's conversions exactly (tested against CUDA's host-side cuda_fp8.h and
// cuda_bf16.h for every FP8 code and for rounding ties, NaN, infinities and saturation).
#pragma once

#include <cstdint>

namespace speedmla {

// FP8 e4m3fn -> float. All 256 codes; 0x7F and 0xFF are NaN.
float fp8_e4m3_to_float(uint8_t code);
// float -> FP8 e4m3fn, round to nearest even, saturating to ±448 (±inf saturate too); NaN -> 0x7F.
uint8_t float_to_fp8_e4m3(float value);

// bfloat16 (raw bits) -> float, exact.
float bf16_to_float(uint16_t bits);
// float -> bfloat16, round to nearest even; NaN stays NaN (quiet).
uint16_t float_to_bf16(float value);

// float16 (raw bits) <-> float, round to nearest even.
float fp16_to_float(uint16_t bits);
uint16_t float_to_fp16(float value);

}  // namespace speedmla
