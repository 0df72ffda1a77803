#include "gpu/quantizer.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "gpu/host_quantizer.h"

namespace kvcache::gpu {
namespace {

// The scratch buffer grows to fit a call, between these bounds; a larger call
// goes out in several submissions.
constexpr uint64_t kMinScratchBytes = 64 << 10;
constexpr uint64_t kMaxScratchBytes = 32 << 20;
// Run-table entries per submission (dispatches take at most 65535 along y).
constexpr uint32_t kMaxRuns = 16384;
// Invocations per workgroup (kLocalSize in shaders/quant_common.glsl), one
// group each.
constexpr uint64_t kLocalSize = 64;
// Groups of one shader run: at most 65535 workgroups along x.
constexpr uint64_t kMaxRunGroups = 65535 * kLocalSize - 1;
// Scratch rows of each run start 16-byte aligned (the shaders load quads).
constexpr uint64_t kScratchAlignment = 16;

uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

absl::Status CheckFormat(const char* call, size_t job, const QuantFormat& f) {
  const auto invalid = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(call, " jobs[", job, "].format.", why));
  };
  if (!IsValidDType(static_cast<uint32_t>(f.dtype))) return invalid("dtype: not a dtype");
  if (f.group_size != 32 && f.group_size != 64 && f.group_size != 128) {
    return invalid(absl::StrCat("group_size: ", f.group_size, " is not 32, 64 or 128"));
  }
  if (f.bits != 4 && f.bits != 8) return invalid(absl::StrCat("bits: ", f.bits, " is not 4 or 8"));
  if (f.dim == 0 || f.dim % f.group_size != 0) {
    return invalid(
        absl::StrCat("dim: ", f.dim, " is not a positive multiple of group_size ", f.group_size));
  }
  return absl::OkStatus();
}

uint64_t PiecesBytes(absl::Span<const absl::Span<const std::byte>> pieces) {
  uint64_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  return total;
}

// Copies bytes [offset, offset + bytes) of the pieces' concatenation to `dst`.
void CopyFromPieces(absl::Span<const absl::Span<const std::byte>> pieces, uint64_t offset,
                    std::byte* dst, uint64_t bytes) {
  for (const auto& piece : pieces) {
    if (bytes == 0) return;
    if (offset >= piece.size()) {
      offset -= piece.size();
      continue;
    }
    const uint64_t take = std::min<uint64_t>(bytes, piece.size() - offset);
    std::memcpy(dst, piece.data() + offset, take);
    dst += take;
    bytes -= take;
    offset = 0;
  }
}

uint64_t TensorBytes(const QuantizeJob& job) { return PiecesBytes(job.input); }
uint64_t TensorBytes(const DequantizeJob& job) { return job.output.size(); }

}  // namespace

// The shader runs of one submission, grouped by (job, slab), and (Dequantize)
// the scratch ranges to copy out once it completes.
struct Quantizer::Batch {
  struct Group {
    std::vector<QuantShaderRun> runs;
    uint64_t max_groups = 0;
  };
  struct Output {
    uint64_t scratch_offset;
    std::byte* dst;
    uint64_t bytes;
  };
  // (job, slab, packed words 16-byte aligned) -> its runs
  absl::flat_hash_map<std::tuple<size_t, VkBuffer, bool>, Group> groups;
  std::vector<Output> outputs;
  uint32_t run_count = 0;
  uint64_t scratch_used = 0;

  void Clear() {
    groups.clear();
    outputs.clear();
    run_count = 0;
    scratch_used = 0;
  }
};

Quantizer::Quantizer(const Device& device, const PageAllocator& pages, QuantizerOptions options)
    : device_(device),
      pages_(pages),
      options_(options),
      on_host_(pages.host_mapped() && device.direct_host_access() &&
               (options.kernel == QuantKernel::kHost ||
                (options.kernel == QuantKernel::kAuto && device.description().type == "cpu"))) {}

Quantizer::~Quantizer() = default;

absl::Status Quantizer::CheckRun(const char* call, size_t job, size_t index, const QuantFormat& f,
                                 const QuantRun& run, uint64_t tensor_rows) const {
  const auto invalid = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, " jobs[", job, "].runs[", index, "]: ", why));
  };
  if (!pages_.IsBacked(run.page)) {
    return invalid(absl::StrCat("page ", run.page, " is not a page of this pool"));
  }
  if (run.first_row > tensor_rows || run.rows > tensor_rows - run.first_row) {
    return invalid(absl::StrCat("rows [", run.first_row, ", ", run.first_row + run.rows,
                                ") are outside the ", tensor_rows, "-row tensor"));
  }
  const uint64_t page_bytes = pages_.plan().page_bytes;
  const uint64_t slab_offset = pages_.Locate(run.page).offset;
  const struct {
    const char* name;
    uint64_t offset;
    uint64_t row_bytes;
    uint64_t alignment;
  } planes[] = {{"wq", run.wq_offset, f.wq_row_bytes(), 4},
                {"scales", run.scales_offset, f.scale_row_bytes(), DTypeSize(f.dtype)},
                {"biases", run.biases_offset, f.scale_row_bytes(), DTypeSize(f.dtype)}};
  for (const auto& plane : planes) {
    if (plane.offset > page_bytes || run.rows * plane.row_bytes > page_bytes - plane.offset) {
      return invalid(absl::StrCat(plane.name, " bytes [", plane.offset, ", ",
                                  plane.offset + run.rows * plane.row_bytes,
                                  ") cross the end of the ", page_bytes, "-byte page ", run.page));
    }
    if ((slab_offset + plane.offset) % plane.alignment != 0) {
      return invalid(absl::StrCat(plane.name, " at page byte ", plane.offset, " is not ",
                                  plane.alignment, "-byte aligned in its slab"));
    }
  }
  return absl::OkStatus();
}

absl::Status Quantizer::Prepare(uint64_t wanted_bytes) {
  if (pipelines_ == nullptr) {
    ASSIGN_OR_RETURN(pipelines_, QuantPipelines::Create(device_, options_.subgroup_shuffle));
    ASSIGN_OR_RETURN(runner_, CommandRunner::Create(device_));
    ASSIGN_OR_RETURN(
        run_table_,
        CreateBuffer(device_, {.bytes = kMaxRuns * sizeof(QuantShaderRun),
                               .usage = vk::BufferUsageFlagBits::eStorageBuffer,
                               .required_memory = vk::MemoryPropertyFlagBits::eHostVisible |
                                                  vk::MemoryPropertyFlagBits::eHostCoherent,
                               .host_mapped = true}));
  }
  const uint64_t most = std::min(kMaxScratchBytes, device_.max_storage_buffer_range());
  uint64_t bytes = kMinScratchBytes;
  while (bytes < wanted_bytes && bytes < most) bytes *= 2;
  bytes = std::min(bytes, most);
  if (scratch_ != nullptr && scratch_->bytes >= bytes) return absl::OkStatus();
  pipelines_->ForgetSets();  // they bind the old scratch buffer
  scratch_.reset();
  // Host-cached where there is a choice: Dequantize copies back out of it.
  ASSIGN_OR_RETURN(
      scratch_, CreateBuffer(device_, {.bytes = bytes,
                                       .usage = vk::BufferUsageFlagBits::eStorageBuffer,
                                       .required_memory = vk::MemoryPropertyFlagBits::eHostVisible |
                                                          vk::MemoryPropertyFlagBits::eHostCoherent,
                                       .preferred_memory = vk::MemoryPropertyFlagBits::eHostCached,
                                       .host_mapped = true}));
  return absl::OkStatus();
}

void Quantizer::AddRun(Batch& batch, size_t job, const QuantRun& run, uint64_t first_row,
                       uint32_t rows, uint64_t scratch_offset, const QuantFormat& f) const {
  const PageLocation location = pages_.Locate(run.page);
  const uint64_t skipped = first_row - run.first_row;  // rows of the run already planned
  const uint64_t groups = uint64_t{rows} * (f.dim / f.group_size);
  const uint64_t wq_byte = location.offset + run.wq_offset + skipped * f.wq_row_bytes();
  Batch::Group& group =
      batch.groups[{job, static_cast<VkBuffer>(location.slab), wq_byte % 16 == 0}];
  group.runs.push_back(
      QuantShaderRun{.scratch_byte = static_cast<uint32_t>(scratch_offset),
                     .wq_byte = static_cast<uint32_t>(wq_byte),
                     .scales_byte = static_cast<uint32_t>(location.offset + run.scales_offset +
                                                          skipped * f.scale_row_bytes()),
                     .biases_byte = static_cast<uint32_t>(location.offset + run.biases_offset +
                                                          skipped * f.scale_row_bytes()),
                     .groups = static_cast<uint32_t>(groups),
                     .unused = {}});
  group.max_groups = std::max(group.max_groups, groups);
  ++batch.run_count;
}

template <typename Job, typename Stage, typename Flush>
absl::Status Quantizer::Plan(absl::Span<const Job> jobs, Batch& batch, Stage&& stage,
                             Flush&& flush) {
  for (size_t j = 0; j < jobs.size(); ++j) {
    const QuantFormat& f = jobs[j].format;
    const uint64_t most_rows = kMaxRunGroups / (f.dim / f.group_size);
    for (const QuantRun& run : jobs[j].runs) {
      for (uint64_t row = run.first_row; row < run.first_row + run.rows;) {
        const uint64_t at = AlignUp(batch.scratch_used, kScratchAlignment);
        const uint64_t fit = at >= scratch_->bytes ? 0 : (scratch_->bytes - at) / f.row_bytes();
        const uint64_t rows = std::min({fit, most_rows, run.first_row + run.rows - row});
        if (rows == 0 || batch.run_count == kMaxRuns) {
          if (batch.run_count == 0) {
            return absl::InternalError("quantizer: one row does not fit the scratch buffer");
          }
          RETURN_IF_ERROR(flush());
          continue;
        }
        stage(batch, jobs[j], row, rows, at);
        AddRun(batch, j, run, row, static_cast<uint32_t>(rows), at, f);
        batch.scratch_used = at + rows * f.row_bytes();
        row += rows;
      }
    }
  }
  return flush();
}

absl::Status Quantizer::Submit(QuantDirection direction, absl::Span<const QuantFormat> formats,
                               Batch& batch) {
  if (batch.run_count == 0) return absl::OkStatus();
  // Taken under the lock for the recorder, which Run calls before it returns.
  QuantPipelines& pipelines = *pipelines_;
  const Buffer& scratch = *scratch_;
  const Buffer& run_table = *run_table_;
  absl::Status status = runner_->Run(
      [&](const vk::raii::CommandBuffer& commands) -> absl::Status {
        auto* table = reinterpret_cast<QuantShaderRun*>(run_table.mapped);
        uint32_t next = 0;
        for (const auto& [key, group] : batch.groups) {
          const auto& [job, slab, wq_aligned] = key;
          const QuantFormat& f = formats[job];
          commands.bindPipeline(
              vk::PipelineBindPoint::eCompute,
              pipelines.Get({direction, f.dtype, f.group_size, f.bits, wq_aligned}));
          ASSIGN_OR_RETURN(const vk::DescriptorSet set,
                           pipelines.SetFor(*scratch.buffer, slab, *run_table.buffer));
          commands.bindDescriptorSets(vk::PipelineBindPoint::eCompute, *pipelines.layout(), 0,
                                      set, {});
          std::copy(group.runs.begin(), group.runs.end(), table + next);
          const QuantPush push{next, static_cast<uint32_t>(group.runs.size())};
          commands.pushConstants<QuantPush>(*pipelines.layout(),
                                            vk::ShaderStageFlagBits::eCompute, 0, push);
          // Quantize starts a run's groups one invocation late when its scales
          // plane is out of phase with 32-bit words (see quantize.comp).
          const uint64_t extra = direction == QuantDirection::kQuantize ? 1 : 0;
          const uint64_t tiles = (group.max_groups + extra + kLocalSize - 1) / kLocalSize;
          commands.dispatch(static_cast<uint32_t>(tiles), push.run_count, 1);
          next += push.run_count;
        }
        return absl::OkStatus();
      });
  if (status.ok()) {
    for (const Batch::Output& out : batch.outputs) {
      std::memcpy(out.dst, scratch.mapped + out.scratch_offset, out.bytes);
    }
  }
  batch.Clear();
  return status;
}

namespace {

// Validates formats, tensor sizes and runs of `jobs`; fills `formats` and the
// scratch bytes the whole call would take.
template <typename Job, typename CheckRunFn>
absl::Status CheckJobs(const char* call, absl::Span<const Job> jobs, CheckRunFn&& check_run,
                       std::vector<QuantFormat>& formats, uint64_t& scratch_bytes) {
  for (size_t j = 0; j < jobs.size(); ++j) {
    const QuantFormat& f = jobs[j].format;
    RETURN_IF_ERROR(CheckFormat(call, j, f));
    const uint64_t bytes = TensorBytes(jobs[j]);
    if (bytes % f.row_bytes() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(call, " jobs[", j, "]: a ", bytes,
                                                     "-byte tensor is not whole rows of ",
                                                     f.row_bytes(), " bytes"));
    }
    for (size_t r = 0; r < jobs[j].runs.size(); ++r) {
      RETURN_IF_ERROR(check_run(j, r, f, jobs[j].runs[r], bytes / f.row_bytes()));
      scratch_bytes += AlignUp(jobs[j].runs[r].rows * f.row_bytes(), kScratchAlignment);
    }
    formats.push_back(f);
  }
  return absl::OkStatus();
}

}  // namespace

template <typename Job, typename HostKernel, typename Stage>
absl::Status Quantizer::RunJobs(QuantDirection direction, absl::Span<const Job> jobs,
                                HostKernel&& on_host, Stage&& stage) {
  const char* call = direction == QuantDirection::kQuantize ? "Quantize" : "Dequantize";
  std::vector<QuantFormat> formats;
  uint64_t scratch_bytes = 0;
  RETURN_IF_ERROR(CheckJobs(
      call, jobs,
      [&](size_t j, size_t r, const QuantFormat& f, const QuantRun& run, uint64_t rows) {
        return CheckRun(call, j, r, f, run, rows);
      },
      formats, scratch_bytes));
  if (scratch_bytes == 0) return absl::OkStatus();  // no rows: nothing to build or run
  if (on_host_) {
    on_host(options_.host_isa, pages_, jobs);
    return absl::OkStatus();
  }
  absl::MutexLock lock(&mutex_);
  RETURN_IF_ERROR(Prepare(scratch_bytes));
  Batch batch;
  return Plan(jobs, batch, stage,
              [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
                return Submit(direction, formats, batch);
              });
}

absl::Status Quantizer::Quantize(absl::Span<const QuantizeJob> jobs) {
  return RunJobs(QuantDirection::kQuantize, jobs, QuantizeOnHost,
                 [&](Batch&, const QuantizeJob& job, uint64_t row, uint64_t rows,
                     uint64_t at) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
                   const uint64_t row_bytes = job.format.row_bytes();
                   CopyFromPieces(job.input, row * row_bytes, scratch_->mapped + at,
                                  rows * row_bytes);
                 });
}

absl::Status Quantizer::Dequantize(absl::Span<const DequantizeJob> jobs) {
  return RunJobs(QuantDirection::kDequantize, jobs, DequantizeOnHost,
                 [](Batch& batch, const DequantizeJob& job, uint64_t row, uint64_t rows,
                    uint64_t at) {
                   const uint64_t row_bytes = job.format.row_bytes();
                   batch.outputs.push_back(
                       {at, job.output.data() + row * row_bytes, rows * row_bytes});
                 });
}

}  // namespace kvcache::gpu
