// quantize.comp for devices without subgroup shuffles: the same arithmetic,
// every 16-bit scale and bias written as an atomic half word.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_basic : require

#include "quant_common.glsl"
#include "quantize_body.glsl"
