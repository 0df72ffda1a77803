// The body of quantize.comp and quantize_atomic.comp (see quantize.comp).

layout(local_size_x = kLocalSize) in;

// Where the device can shuffle within a subgroup (QUANT_PAIR_BY_SHUFFLE),
// pairs of invocations write their two 16-bit scales (and biases) as one word;
// otherwise each half word is written atomically.
#ifdef QUANT_PAIR_BY_SHUFFLE
const bool kPairByShuffle = true;
#else
const bool kPairByShuffle = false;
#endif

layout(std430, set = 0, binding = 0) readonly buffer ScratchQuads { uvec4 scratch_quads[]; };
// The slab is bound once and viewed both as words and as 16-byte quads.
layout(std430, set = 0, binding = 1) buffer Slab { uint slab_words[]; };
layout(std430, set = 0, binding = 1) writeonly buffer SlabQuads { uvec4 slab_quads[]; };
layout(std430, set = 0, binding = 2) readonly buffer Runs { QuantRun runs[]; };

const uint kQuads = kInputWordsPerGroup / 4u;  // 4 .. 32 quads of input a group
// A step packs two quads of input into 4 (16-bit, 8 bits), 2 or 1 words.
const uint kBitsPerQuad = 4u * kValuesPerInputWord * kBits;  // 64, 32 or 16
const uint kWordsPerStep = kBitsPerQuad / 16u;

struct Affine {
  float scale;
  float bias;
};

// Sign-magnitude float bits -> an unsigned key with the same order, and back.
uint OrderKey(uint f) {
  return f ^ (uint(int(f) >> 31) | 0x80000000u);
}

uint KeyToFloatBits(uint key) {
  return (key & 0x80000000u) != 0u ? key & 0x7FFFFFFFu : ~key;
}

// Two 16-bit values are keyed at once, on their own bits: f16 and bf16 order
// as their bit patterns do.
void AccumulateRange(uint word, inout uint min_key, inout uint max_key) {
  if (kElemBytes == 4u) {
    const uint key = OrderKey(word);
    min_key = min(min_key, key);
    max_key = max(max_key, key);
    return;
  }
  const uint keys = word ^ ((((word >> 15) & 0x00010001u) * 0x7FFFu) | 0x80008000u);
  min_key = min(min_key, min(keys & 0xFFFFu, keys >> 16));
  max_key = max(max_key, max(keys & 0xFFFFu, keys >> 16));
}

void AccumulateQuad(uvec4 quad, inout uint min_key, inout uint max_key) {
  AccumulateRange(quad.x, min_key, max_key);
  AccumulateRange(quad.y, min_key, max_key);
  AccumulateRange(quad.z, min_key, max_key);
  AccumulateRange(quad.w, min_key, max_key);
}

// A key back to the value's float bits.
uint KeyToValueBits(uint key) {
  if (kElemBytes == 4u) return KeyToFloatBits(key);
  const uint bits16 = (key & 0x8000u) != 0u ? key & 0x7FFFu : ~key & 0xFFFFu;
  return ElementBits(bits16, 0u);
}

// a / b rounded to nearest, as the CPU reference (and mlx) divide. Vulkan lets
// a shader's division be 2.5 ulp off (NVIDIA's is, measured on an H200), which
// flips scales and quantized values; so the quotient is moved by its exact
// remainder (fma(-q, b, a): exact where fma is fused, as on every device with
// an FMA unit) until no neighbour is closer. A quotient of two floats never
// lies exactly between two floats, so the closest is the rounded one. Each
// pass moves one ulp; 2.5 ulp off can be 5 steps where the quotient crosses a
// power of two (the ulp halves below it), so 6 passes. A driver whose fma is
// not fused would fail the quantize tests against the CPU reference (they
// compare every bit), which is how the H200's division was found.
float Divide(float a, float b) {
  precise float q = a / b;
  if (isinf(q) || isnan(q) || q == 0.0) return q;
  for (uint pass = 0u; pass < 6u; ++pass) {
    precise float remainder = fma(-q, b, a);
    if (remainder == 0.0) break;
    // q's neighbour on the side of the exact quotient.
    const bool upward = (remainder > 0.0) == (b > 0.0);
    const int step = upward == (q > 0.0) ? 1 : -1;
    precise float next = uintBitsToFloat(uint(int(floatBitsToUint(q)) + step));
    precise float next_remainder = fma(-next, b, a);
    if (abs(next_remainder) >= abs(remainder)) break;
    q = next;
  }
  return q;
}

// mlx: scale from the range, then snapped so the larger-magnitude end is exact.
Affine FitGroup(uint min_key, uint max_key) {
  const uint min_bits = KeyToValueBits(min_key);
  const uint max_bits = KeyToValueBits(max_key);
  const float w_min = uintBitsToFloat(min_bits);
  const float w_max = uintBitsToFloat(max_bits);
  const bool mask = (min_bits & 0x7FFFFFFFu) > (max_bits & 0x7FFFFFFFu);  // |w_min| > |w_max|
  float scale = max(Divide(w_max - w_min, float(kValueMask)), 1e-7);
  scale = mask ? scale : -scale;
  const float edge = mask ? w_min : w_max;
  const float q0 = roundEven(Divide(edge, scale));
  Affine affine = Affine(scale, 0.0);
  if (q0 != 0.0) {
    affine.scale = Divide(edge, q0);
    affine.bias = edge;
  }
  return affine;
}

// The quantized values of input word `word`, packed from bit `shift` up.
uint PackInputWord(uint word, uint shift, Affine affine) {
  uint packed = 0u;
  for (uint e = 0u; e < kValuesPerInputWord; ++e) {
    const float value = uintBitsToFloat(ElementBits(word, e));
    float q = roundEven(Divide(value - affine.bias, affine.scale));
    q = min(max(q, 0.0), float(kValueMask));
    packed |= uint(int(q)) << (shift + e * kBits);
  }
  return packed;
}

// Packs a quad of input from bit `shift`: the first 32 bits into `low`, the
// rest into `high`.
void PackQuad(uvec4 quad, uint shift, Affine affine, inout uint low, inout uint high) {
  const uint step = kValuesPerInputWord * kBits;
  if (shift + 2u * step <= 32u) {
    low |= PackInputWord(quad.x, shift, affine) | PackInputWord(quad.y, shift + step, affine);
  } else {
    high |= PackInputWord(quad.x, shift % 32u, affine) |
            PackInputWord(quad.y, (shift + step) % 32u, affine);
  }
  if (shift + 4u * step <= 32u) {
    low |= PackInputWord(quad.z, shift + 2u * step, affine) |
           PackInputWord(quad.w, shift + 3u * step, affine);
  } else {
    high |= PackInputWord(quad.z, (shift + 2u * step) % 32u, affine) |
            PackInputWord(quad.w, (shift + 3u * step) % 32u, affine);
  }
}

// Packs quads `first` and `second` (step `index` of the group) into packed
// words and writes them from word `wq_word` of the group.
void PackStep(uint wq_word, uint index, uvec4 first, uvec4 second, Affine affine) {
  uint words[4] = uint[4](0u, 0u, 0u, 0u);
  PackQuad(first, 0u, affine, words[0], words[1]);
  if (kBitsPerQuad == 64u) {
    PackQuad(second, 0u, affine, words[2], words[3]);
  } else if (kBitsPerQuad == 32u) {
    PackQuad(second, 0u, affine, words[1], words[3]);
  } else {
    PackQuad(second, 16u, affine, words[0], words[3]);
  }
  const uint at = wq_word + index * kWordsPerStep;
  if (kWordsPerStep == 4u && kWqQuadAligned) {
    slab_quads[at / 4u] = uvec4(words[0], words[1], words[2], words[3]);
  } else {
    for (uint w = 0u; w < kWordsPerStep; ++w) slab_words[at + w] = words[w];
  }
}

// Half `half_index` (0: low) of word `word`, whose other half belongs to a row
// this invocation does not write: atomically, leaving the other half alone.
void StoreHalf(uint word, uint half_index, uint bits) {
  const uint shift = 16u * half_index;
  atomicAnd(slab_words[word], ~(0xFFFFu << shift));
  atomicOr(slab_words[word], bits << shift);
}

// This invocation's 16-bit element of a plane whose element 0 is at
// `plane_byte`. `paired`: the element's word is shared with the element of
// subgroup invocation (id ^ 1), so the even one of the two writes it whole.
// Must be called by the whole subgroup (it shuffles).
void StoreElement(uint plane_byte, uint group, bool valid, uint bits, bool paired) {
  const uint element = plane_byte / 2u + group;
#ifdef QUANT_PAIR_BY_SHUFFLE
  if (paired) {
    const uint partner_bits = subgroupShuffleXor(bits, 1u);
    const bool partner_valid = subgroupShuffleXor(valid ? 1u : 0u, 1u) != 0u;
    if (!valid) return;
    const bool low_half = (gl_SubgroupInvocationID & 1u) == 0u;
    if (partner_valid && low_half) {
      slab_words[element / 2u] = bits | (partner_bits << 16);
    } else if (!partner_valid) {
      StoreHalf(element / 2u, element & 1u, bits);
    }
    return;
  }
#endif
  if (valid) StoreHalf(element / 2u, element & 1u, bits);
}

void main() {
  const QuantRun run = runs[push.first_run + gl_WorkGroupID.y];
  // Subgroup lanes 2k and 2k + 1 take neighbouring groups whose scales share
  // a word: the first group is shifted by the scales plane's phase.
  const uint lane = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
  const uint phase = kElemBytes == 2u ? (run.scales_byte / 2u) & 1u : 0u;
  const uint group = gl_WorkGroupID.x * kLocalSize + lane - phase;  // wraps below 0: invalid
  const bool valid = group < run.groups;
  Affine affine = Affine(0.0, 0.0);
  if (valid) {
    const uint first_quad = run.scratch_byte / 16u + group * kQuads;
    uint min_key = 0xFFFFFFFFu;
    uint max_key = 0u;
    for (uint q = 0u; q < kQuads; ++q) {
      AccumulateQuad(scratch_quads[first_quad + q], min_key, max_key);
    }
    affine = FitGroup(min_key, max_key);
    const uint wq_word = run.wq_byte / 4u + group * kWordsPerGroup;
    for (uint step = 0u; step < kQuads / 2u; ++step) {
      PackStep(wq_word, step, scratch_quads[first_quad + 2u * step],
               scratch_quads[first_quad + 2u * step + 1u], affine);
    }
    if (kElemBytes == 4u) {
      slab_words[run.scales_byte / 4u + group] = floatBitsToUint(affine.scale);
      slab_words[run.biases_byte / 4u + group] = floatBitsToUint(affine.bias);
    }
  }
  if (kElemBytes == 4u) return;
  const uint scale_bits = DTypeBits(floatBitsToUint(affine.scale));
  const uint bias_bits = DTypeBits(floatBitsToUint(affine.bias));
  StoreElement(run.scales_byte, group, valid, scale_bits, true);
  // The biases plane pairs the same way unless an odd number of elements lies
  // between the two planes.
  StoreElement(run.biases_byte, group, valid, bias_bits, ((run.biases_byte / 2u) & 1u) == phase);
}
