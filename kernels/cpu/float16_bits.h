// float16, bfloat16 and float8 (e4m3fn) bits to float, exactly: shared by the C++ operators of
// kernels/cpu/.
#pragma once

#include <cstdint>

namespace {
// A bfloat16 (its bits) as a float: the bits shifted into the high half.
inline float bfloat16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float value;
  __builtin_memcpy(&value, &bits, sizeof value);
  return value;
}

// A float16 (its bits) as a float: normals, subnormals, zeros, infinities and NaNs.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float value;
  __builtin_memcpy(&value, &bits, sizeof value);
  return value;
}

// A float8 e4m3fn (its bits: sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities)
// as the float16 bits of its value / 256: the exponent and mantissa bits moved into float16's
// places (whose bias is 15), subnormals included. Its one NaN (S.1111.111, which no finite
// value rounds to) reads as +-480 here: a NaN K/V comes from a NaN hidden state, which stays NaN
// whatever attention adds to it. The vector builds of the attention do the same per lane.
inline uint16_t float8_e4m3fn_to_half_256th(uint8_t b) {
  return static_cast<uint16_t>((b & 0x80) << 8 | (b & 0x7F) << 7);
}

// A float8 e4m3fn (its bits) as a float: exact (NaN as +-480: float8_e4m3fn_to_half_256th).
inline float float8_e4m3fn_to_float(uint8_t b) {
  return half_to_float(float8_e4m3fn_to_half_256th(b)) * 256.0f;
}
}  // namespace
