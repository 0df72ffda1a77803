// mlx affine dequantization of page planes into rows of the scratch buffer:
// one invocation per group, value = scale * q + bias in float32 (no fused
// multiply-add: `precise`), rounded once to the dtype.
//
//   dispatch (tiles, run_count, 1): workgroup (t, r) dequantizes groups
//   [t * kLocalSize, (t + 1) * kLocalSize) of run first_run + r.
//
// As in quantize.comp, memory is read and written as quads where aligned.
#version 450
#extension GL_GOOGLE_include_directive : require

#include "quant_common.glsl"

layout(local_size_x = kLocalSize) in;

layout(std430, set = 0, binding = 0) writeonly buffer ScratchQuads { uvec4 scratch_quads[]; };
// The slab is bound once and viewed both as words and as 16-byte quads.
layout(std430, set = 0, binding = 1) readonly buffer Slab { uint slab_words[]; };
layout(std430, set = 0, binding = 1) readonly buffer SlabQuads { uvec4 slab_quads[]; };
layout(std430, set = 0, binding = 2) readonly buffer Runs { QuantRun runs[]; };

const uint kOutQuads = kInputWordsPerGroup / 4u;  // 4 .. 32 quads of values a group

float LoadElement(uint byte_offset) {
  const uint word = slab_words[byte_offset / 4u];
  if (kElemBytes == 4u) return uintBitsToFloat(word);
  return DTypeBitsToFloat((word >> ((byte_offset & 2u) * 8u)) & 0xFFFFu);
}

// One output word: the values packed in `packed` from bit `shift`.
uint UnpackWord(uint packed, uint shift, float scale, float bias) {
  uint out_word = 0u;
  for (uint e = 0u; e < kValuesPerInputWord; ++e) {
    const uint q = (packed >> (shift + e * kBits)) & kValueMask;
    precise float value = scale * float(q) + bias;
    out_word |= DTypeBits(floatBitsToUint(value)) << (16u * e);
  }
  return out_word;
}

void main() {
  const QuantRun run = runs[push.first_run + gl_WorkGroupID.y];
  const uint group = gl_WorkGroupID.x * kLocalSize + gl_LocalInvocationID.x;
  if (group >= run.groups) return;
  const float scale = LoadElement(run.scales_byte + group * kElemBytes);
  const float bias = LoadElement(run.biases_byte + group * kElemBytes);
  const uint wq_word = run.wq_byte / 4u + group * kWordsPerGroup;
  const uint first_out = run.scratch_byte / 16u + group * kOutQuads;
  uint pending_low = 0u;
  uint pending_high = 0u;
  // A quad of packed words at a time: it makes 2, 4 or 8 quads of values.
  const uint step = kValuesPerInputWord * kBits;  // packed bits of one output word
  for (uint w = 0u; w < kWordsPerGroup; w += 4u) {
    const uvec4 packed =
        kWqQuadAligned ? slab_quads[(wq_word + w) / 4u]
                       : uvec4(slab_words[wq_word + w], slab_words[wq_word + w + 1u],
                               slab_words[wq_word + w + 2u], slab_words[wq_word + w + 3u]);
    for (uint k = 0u; k < 4u; ++k) {
      // Packed word k holds the values of kInputWordsPerWord output words.
      uint out_words[8];
      for (uint i = 0u; i < kInputWordsPerWord; ++i) {
        out_words[i] = UnpackWord(packed[k], i * step, scale, bias);
      }
      const uint out_word = (w + k) * kInputWordsPerWord;  // in the group's output
      if (kInputWordsPerWord >= 4u) {
        for (uint i = 0u; i < kInputWordsPerWord; i += 4u) {
          scratch_quads[first_out + (out_word + i) / 4u] =
              uvec4(out_words[i], out_words[i + 1u], out_words[i + 2u], out_words[i + 3u]);
        }
      } else if ((k & 1u) == 1u) {  // two output words a packed word: a quad every other
        scratch_quads[first_out + (out_word - 2u) / 4u] =
            uvec4(pending_low, pending_high, out_words[0], out_words[1]);
      } else {
        pending_low = out_words[0];
        pending_high = out_words[1];
      }
    }
  }
}
