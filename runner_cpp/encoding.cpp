#include "encoding.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// Plain loops the compiler vectorizes. Built with -ffp-contract=off (CMakeLists.txt): a fused
// multiply-add would round differently from the Python runner's two float32 operations.

namespace composite {

uint16_t half_from_float(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t biased = (bits >> 23) & 0xffu;
  uint32_t mantissa = bits & 0x7fffffu;
  if (biased == 0xffu) return sign | 0x7c00u | (mantissa ? 0x200u : 0u);  // infinity, NaN
  const int exponent = static_cast<int>(biased) - 127 + 15;               // in binary16's bias
  if (exponent >= 31) return sign | 0x7c00u;                              // beyond binary16: infinity
  uint32_t significand, rest, halfway;
  if (exponent <= 0) {  // a binary16 subnormal: k * 2^-24
    if (exponent < -10) return sign;
    mantissa |= 0x800000u;  // the implicit leading one
    const int shift = 14 - exponent;
    significand = mantissa >> shift;
    rest = mantissa & ((1u << shift) - 1);
    halfway = 1u << (shift - 1);
  } else {
    significand = (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
    rest = mantissa & 0x1fffu;
    halfway = 0x1000u;
  }
  if (rest > halfway || (rest == halfway && (significand & 1u))) ++significand;  // may carry up to infinity
  return static_cast<uint16_t>(sign | significand);
}

float float_from_half(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent == 0) {  // zero or subnormal: exact in float32
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

namespace {

template <typename Q>
void quantize(const float* x, const Encoding& to, Q* q, size_t n) {
  const float inverse = static_cast<float>(1.0 / static_cast<double>(to.scale));
  const float zero_point = static_cast<float>(to.zero_point);
  const float top = static_cast<float>(to.kind == Encoding::Kind::UInt8 ? 255 : 65535);
  for (size_t i = 0; i < n; ++i) {
    float v = x[i] * inverse;
    v = v + zero_point;
    v = std::min(std::max(v, 0.f), top);
    q[i] = static_cast<Q>(v + 0.5f);  // v + 0.5 >= 0: truncation is floor
  }
}

template <typename Q>
void dequantize(const Q* q, const Encoding& from, float* x, size_t n) {
  const float zero_point = static_cast<float>(from.zero_point);
  for (size_t i = 0; i < n; ++i) x[i] = (static_cast<float>(q[i]) - zero_point) * from.scale;
}

void to_float(const void* source, const Encoding& from, float* x, size_t n) {
  switch (from.kind) {
    case Encoding::Kind::Float32:
      std::copy_n(static_cast<const float*>(source), n, x);
      break;
    case Encoding::Kind::Float16:
      for (size_t i = 0; i < n; ++i) x[i] = float_from_half(static_cast<const uint16_t*>(source)[i]);
      break;
    case Encoding::Kind::UInt8:
      dequantize(static_cast<const uint8_t*>(source), from, x, n);
      break;
    case Encoding::Kind::UInt16:
      dequantize(static_cast<const uint16_t*>(source), from, x, n);
      break;
  }
}

void from_float(const float* x, const Encoding& to, void* target, size_t n) {
  switch (to.kind) {
    case Encoding::Kind::Float32:
      std::copy_n(x, n, static_cast<float*>(target));
      break;
    case Encoding::Kind::Float16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(target)[i] = half_from_float(x[i]);
      break;
    case Encoding::Kind::UInt8:
      quantize(x, to, static_cast<uint8_t*>(target), n);
      break;
    case Encoding::Kind::UInt16:
      quantize(x, to, static_cast<uint16_t*>(target), n);
      break;
  }
}

}  // namespace

Encoding Encoding::of(const TensorDesc& desc) {
  Encoding e;
  if (desc.dtype == "float16") e.kind = Kind::Float16;
  if (desc.dtype == "uint8" || desc.dtype == "uint16") {
    e.kind = desc.dtype == "uint8" ? Kind::UInt8 : Kind::UInt16;
    e.scale = static_cast<float>(desc.scale);
    e.zero_point = static_cast<int32_t>(desc.zero_point);
  }
  return e;
}

void convert(const void* source, const Encoding& from, void* target, const Encoding& to, size_t n) {
  if (from.kind == Encoding::Kind::Float32) {
    from_float(static_cast<const float*>(source), to, target, n);
  } else if (to.kind == Encoding::Kind::Float32) {
    to_float(source, from, static_cast<float*>(target), n);
  } else {  // between two quantizations: through float32, as the Python runner does
    std::vector<float> x(n);
    to_float(source, from, x.data(), n);
    from_float(x.data(), to, target, n);
  }
}

void fill_zero(void* target, const Encoding& encoding, size_t n) {
  switch (encoding.kind) {
    case Encoding::Kind::Float32:
      std::fill_n(static_cast<float*>(target), n, 0.f);
      break;
    case Encoding::Kind::Float16:
      std::fill_n(static_cast<uint16_t*>(target), n, static_cast<uint16_t>(0));
      break;
    case Encoding::Kind::UInt8:
      std::fill_n(static_cast<uint8_t*>(target), n, static_cast<uint8_t>(encoding.zero_point));
      break;
    case Encoding::Kind::UInt16:
      std::fill_n(static_cast<uint16_t*>(target), n, static_cast<uint16_t>(encoding.zero_point));
      break;
  }
}

}  // namespace composite
