// mlx affine quantization of rows in the scratch buffer into page planes: one
// invocation per group of group_size values.
//
//   dispatch (tiles, run_count, 1): workgroup (t, r) quantizes groups
//   [t * kLocalSize - phase, (t + 1) * kLocalSize - phase) of run first_run + r,
//   where phase (0 or 1) lines neighbouring invocations up with the 32-bit
//   words their 16-bit scales share.
//
// The arithmetic is mlx's CPU kernel, op for op, in float32 (see
// tests/support/ref_quantizer.h); the group's min and max are found on
// order-preserving integer keys, so a device that flushes denormals still picks
// the same ends and the same sign of scale.
//
// Written for CPU devices too (lavapipe runs each memory access as a loop over
// the SIMD lanes): the group is read and written as 16-byte quads, with no
// divergent branches (alignment is a specialization constant) and no atomics
// but at the ends of a run. Loops stay loops: unrolling them by hand cut the
// instructions a value by a quarter but made each pipeline take ~1 s to build.

// This variant pairs 16-bit scales through subgroup shuffles;
// quantize_atomic.comp is the same shader for devices without them.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#define QUANT_PAIR_BY_SHUFFLE

#include "quant_common.glsl"
#include "quantize_body.glsl"
