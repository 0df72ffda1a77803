// Shared by quantize.comp and dequantize.comp: the format (specialization
// constants), the run table, and dtype conversions done with integer bit
// arithmetic, so results are the same on every device (packHalf2x16's rounding
// is implementation-defined, and some devices flush denormals in float ops).
//
// A run is `groups` consecutive groups of group_size values: rows of one
// (batch row, head) lie back to back both in the scratch buffer ([B,H,L,D]
// rows) and in each page plane, so group i of a run is at
//
//   scratch  scratch_byte + i * group_size * elem_bytes     (the values)
//   slab     wq_byte      + i * group_size * bits / 8       (packed words)
//            scales_byte  + i * elem_bytes                  (one scale)
//            biases_byte  + i * elem_bytes                  (one bias)

// Mirrors kvcache::DType.
const uint kFloat32 = 1u;
const uint kFloat16 = 2u;
const uint kBFloat16 = 3u;

layout(constant_id = 0) const uint kDType = 2u;
layout(constant_id = 1) const uint kGroupSize = 64u;
layout(constant_id = 2) const uint kBits = 8u;
// Whether the runs' packed words start 16-byte aligned (moved as quads) or only
// 4-byte aligned (moved as words): the host groups runs by which.
layout(constant_id = 3) const bool kWqQuadAligned = true;

const uint kLocalSize = 64u;
const uint kElemBytes = kDType == kFloat32 ? 4u : 2u;
const uint kValuesPerWord = 32u / kBits;               // packed values per uint32
const uint kWordsPerGroup = kGroupSize / kValuesPerWord;
const uint kValuesPerInputWord = 4u / kElemBytes;      // 1 (f32) or 2 (f16, bf16)
const uint kInputWordsPerGroup = kGroupSize / kValuesPerInputWord;
// Input words that hold the values of one packed word (2, 4 or 8).
const uint kInputWordsPerWord = kValuesPerWord / kValuesPerInputWord;
const uint kValueMask = (1u << kBits) - 1u;

// Mirrors kvcache::gpu::QuantShaderRun (std430: 32 bytes).
struct QuantRun {
  uint scratch_byte;  // 16-byte aligned
  uint wq_byte;       // 4-byte aligned
  uint scales_byte;   // elem_bytes aligned
  uint biases_byte;
  uint groups;
  uint unused0;
  uint unused1;
  uint unused2;
};

// Mirrors kvcache::gpu::QuantPush.
layout(push_constant) uniform Push {
  uint first_run;
  uint run_count;
} push;

// IEEE half bits -> float bits, exactly and without branches: subnormals as
// mantissa * 2^-24 (an exact float product, never itself subnormal).
uint HalfToFloatBits(uint h) {
  const uint exponent = (h >> 10) & 0x1Fu;
  const uint mantissa = h & 0x3FFu;
  uint bits = ((exponent + 112u) << 23) | (mantissa << 13);
  bits = exponent == 0x1Fu ? 0x7F800000u | (mantissa << 13) : bits;
  bits = exponent == 0u ? floatBitsToUint(float(mantissa) * 5.9604644775390625e-8) : bits;
  return ((h & 0x8000u) << 16) | bits;
}

// Float bits -> IEEE half bits, rounded to nearest even; overflow to infinity.
// Without branches: normal halves by integer rounding of the bits; subnormals
// by adding 0.5, which leaves the value's multiple of 2^-24 (rounded to nearest
// even by the float add) in the low mantissa bits. Float denormals, flushed or
// not, round to zero either way.
uint FloatBitsToHalf(uint f) {
  const uint magnitude = f & 0x7FFFFFFFu;
  const uint normal = (magnitude - 0x38000000u + 0xFFFu + ((magnitude >> 13) & 1u)) >> 13;
  const uint subnormal = floatBitsToUint(uintBitsToFloat(magnitude) + 0.5) - 0x3F000000u;
  uint half_bits = magnitude < 0x38800000u ? subnormal : normal;      // below 2^-14
  const uint too_big = magnitude > 0x7F800000u ? 0x7E00u : 0x7C00u;   // NaN : infinity
  half_bits = magnitude >= 0x47800000u ? too_big : half_bits;          // >= 65536
  return ((f >> 16) & 0x8000u) | half_bits;
}

// Float bits -> bfloat16 bits, rounded to nearest even.
uint FloatBitsToBFloat16(uint f) {
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return (f >> 16) | 0x40u;
  return (f + 0x7FFFu + ((f >> 16) & 1u)) >> 16;
}

// Element `index` (0 or 1 within a 16-bit pair) of input word `word`, as float bits.
uint ElementBits(uint word, uint index) {
  if (kDType == kFloat32) return word;
  const uint bits16 = (word >> (16u * index)) & 0xFFFFu;
  return kDType == kFloat16 ? HalfToFloatBits(bits16) : bits16 << 16;
}

// Float bits -> the dtype's bits (low 16 bits for f16 / bf16).
uint DTypeBits(uint f) {
  if (kDType == kFloat32) return f;
  return kDType == kFloat16 ? FloatBitsToHalf(f) : FloatBitsToBFloat16(f);
}

float DTypeBitsToFloat(uint bits) {
  if (kDType == kFloat32) return uintBitsToFloat(bits);
  return uintBitsToFloat(kDType == kFloat16 ? HalfToFloatBits(bits) : bits << 16);
}
