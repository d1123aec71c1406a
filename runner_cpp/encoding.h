// How a hidden state or KV cache crosses a shard boundary, as the manifest describes it: float32,
// float16, or uint8 / uint16 with a scale and zero point. Where a tensor meets a shard that wants
// another encoding, the runner converts through float32 (composite/runtime/encoding.py computes
// the same, bit for bit):
//   quantize    q = floor(clamp(x * (1 / scale) + zero_point, 0, qmax) + 0.5)   (float32 steps)
//   dequantize  x = (q - zero_point) * scale
//   float16     round to nearest even, and back exactly
#pragma once
#include <cstddef>
#include <cstdint>

#include "manifest.h"

namespace composite {

struct Encoding {
  enum class Kind { Float32, Float16, UInt8, UInt16 } kind = Kind::Float32;
  float scale = 1.f;  // quantized kinds only
  int32_t zero_point = 0;

  static Encoding of(const TensorDesc& desc);  // float32, float16, uint8 or uint16 (the readers check)
  size_t element_size() const { return kind == Kind::Float32 ? 4 : kind == Kind::UInt8 ? 1 : 2; }
  bool operator==(const Encoding& other) const {
    return kind == other.kind && scale == other.scale && zero_point == other.zero_point;
  }
  bool operator!=(const Encoding& other) const { return !(*this == other); }
};

// n values from `source` (encoded as `from`) into `target` (encoded as `to`); the buffers must not
// overlap.
void convert(const void* source, const Encoding& from, void* target, const Encoding& to, size_t n);

// Fills n elements with the encoding of 0.0 (the zero point of a quantized tensor).
void fill_zero(void* target, const Encoding& encoding, size_t n);

// IEEE binary16 bits of a float, rounded to nearest even, and the float a binary16 is.
uint16_t half_from_float(float value);
float float_from_half(uint16_t half);

}  // namespace composite
