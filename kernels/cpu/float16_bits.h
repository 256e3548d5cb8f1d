// float16 and bfloat16 bits to float, exactly: shared by the C++ operators of kernels/cpu/.
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
}  // namespace
