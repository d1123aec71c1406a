// Quantized tensors as the manifest describes them (uint8 / uint16 with a scale and zero point),
// and the one conversion both runners apply where a quantized tensor meets a float one:
//   q = floor(clamp(x * (1 / scale) + zero_point, 0, qmax) + 0.5),   x = (q - zero_point) * scale,
// in float32, as composite/runtime/quantized.py computes it, bit for bit.
#pragma once
#include <cstddef>
#include <cstdint>

#include "manifest.h"

namespace composite {

struct Encoding {
  enum class Kind { Float32, UInt8, UInt16 } kind = Kind::Float32;
  float scale = 1.f;
  int32_t zero_point = 0;

  static Encoding of(const TensorDesc& desc);  // float32, uint8 or uint16 (the readers check)
  size_t element_size() const { return kind == Kind::Float32 ? 4 : kind == Kind::UInt16 ? 2 : 1; }
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

}  // namespace composite
