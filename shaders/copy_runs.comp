// Copies a list of runs between two storage buffers (the staging ring and a
// page-pool slab, or two slabs): the compute-shader CopyEngine.
//
//   dispatch (run_count, tiles, 1): workgroup (r, t) copies words
//   [t * kTileWords, (t + 1) * kTileWords) of run first_run + r, clipped to the
//   run; each of its kLocalSize invocations strides over the tile.
//
// Runs are in 32-bit words; gpu/copy_pipeline.cc sends the unaligned head and
// tail bytes of a copy (f16 data can end on a 2-byte boundary) as copy regions.
#version 450

const uint kLocalSize = 64;
const uint kTileWords = 4096;
layout(local_size_x = kLocalSize) in;

// Mirrored by kvcache::gpu::CopyRun (std430: stride 12).
struct Run {
  uint src_word;
  uint dst_word;
  uint words;
};

// Each buffer is bound once and viewed both as words and as 16-byte quads.
layout(std430, set = 0, binding = 0) readonly buffer Source { uint source_words[]; };
layout(std430, set = 0, binding = 0) readonly buffer SourceQuads { uvec4 source_quads[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Destination { uint destination_words[]; };
layout(std430, set = 0, binding = 1) writeonly buffer DestinationQuads { uvec4 destination_quads[]; };
layout(std430, set = 0, binding = 2) readonly buffer Runs { Run runs[]; };

// Mirrored by kvcache::gpu::CopyRunsPush.
layout(push_constant) uniform Push {
  uint first_run;
  uint run_count;
} push;

void main() {
  if (gl_WorkGroupID.x >= push.run_count) return;
  const Run run = runs[push.first_run + gl_WorkGroupID.x];
  const uint tile_start = gl_WorkGroupID.y * kTileWords;
  const uint tile_end = min(run.words, tile_start + kTileWords);
  if (((run.src_word | run.dst_word | run.words) & 3u) == 0u) {
    // 16-byte aligned on both sides (page-sized runs are): four words a load.
    const uint src_quad = run.src_word / 4;
    const uint dst_quad = run.dst_word / 4;
    for (uint q = tile_start / 4 + gl_LocalInvocationID.x; q < tile_end / 4; q += kLocalSize) {
      destination_quads[dst_quad + q] = source_quads[src_quad + q];
    }
    return;
  }
  for (uint w = tile_start + gl_LocalInvocationID.x; w < tile_end; w += kLocalSize) {
    destination_words[run.dst_word + w] = source_words[run.src_word + w];
  }
}
