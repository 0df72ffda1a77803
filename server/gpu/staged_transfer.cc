#include "gpu/staged_transfer.h"

#include <cstring>
#include <utility>

#include "core/status_macros.h"

namespace kvcache::gpu {

absl::StatusOr<std::unique_ptr<StagedTransfer>> StagedTransfer::Create(const Device& device,
                                                                       CopyEngine engine,
                                                                       uint64_t ring_bytes) {
  ASSIGN_OR_RETURN(std::unique_ptr<StagingRing> ring, StagingRing::Create(device, ring_bytes));
  ASSIGN_OR_RETURN(std::unique_ptr<CommandRunner> runner, CommandRunner::Create(device));
  std::unique_ptr<CopyPipeline> pipeline;
  if (engine == CopyEngine::kComputeShader) {
    ASSIGN_OR_RETURN(pipeline, CopyPipeline::Create(device));
  }
  return std::unique_ptr<StagedTransfer>(
      new StagedTransfer(engine, std::move(ring), std::move(runner), std::move(pipeline)));
}

StagedTransfer::StagedTransfer(CopyEngine engine, std::unique_ptr<StagingRing> ring,
                               std::unique_ptr<CommandRunner> runner,
                               std::unique_ptr<CopyPipeline> pipeline)
    : engine_(engine),
      ring_(std::move(ring)),
      runner_(std::move(runner)),
      pipeline_(std::move(pipeline)) {}

absl::Status StagedTransfer::Write(absl::Span<const HostToDevice> writes) {
  absl::MutexLock lock(&mutex_);
  for (const HostToDevice& write : writes) {
    for (uint64_t done = 0; done < write.dst.bytes;) {
      const uint64_t device_offset = write.dst.offset + done;
      ASSIGN_OR_RETURN(const StagingRing::Slice slice,
                       Reserve(device_offset, write.dst.bytes - done));
      std::memcpy(ring_->data() + slice.offset, write.src + done, slice.bytes);
      pending_copies_.push_back(
          {ring_->buffer(), slice.offset, write.dst.buffer, device_offset, slice.bytes});
      done += slice.bytes;
    }
  }
  return Flush();
}

absl::Status StagedTransfer::Read(absl::Span<const DeviceToHost> reads) {
  absl::MutexLock lock(&mutex_);
  for (const DeviceToHost& read : reads) {
    for (uint64_t done = 0; done < read.src.bytes;) {
      const uint64_t device_offset = read.src.offset + done;
      ASSIGN_OR_RETURN(const StagingRing::Slice slice,
                       Reserve(device_offset, read.src.bytes - done));
      pending_copies_.push_back(
          {read.src.buffer, device_offset, ring_->buffer(), slice.offset, slice.bytes});
      pending_reads_.push_back({slice.offset, read.dst + done, slice.bytes});
      done += slice.bytes;
    }
  }
  return Flush();
}

absl::Status StagedTransfer::Copy(absl::Span<const BufferCopy> copies) {
  absl::MutexLock lock(&mutex_);
  for (const BufferCopy& copy : copies) {
    if (pending_copies_.size() == CopyPipeline::kMaxCopies) RETURN_IF_ERROR(Flush());
    pending_copies_.push_back(copy);
  }
  return Flush();
}

absl::StatusOr<StagingRing::Slice> StagedTransfer::Reserve(uint64_t device_offset, uint64_t bytes) {
  if (pending_copies_.size() < CopyPipeline::kMaxCopies) {
    const StagingRing::Slice slice = ring_->Reserve(bytes, device_offset % 4);
    if (slice.bytes > 0) return slice;
  }
  RETURN_IF_ERROR(Flush());
  return ring_->Reserve(bytes, device_offset % 4);  // The empty ring always has room.
}

absl::Status StagedTransfer::Flush() {
  if (pending_copies_.empty()) return absl::OkStatus();
  // Taken under the lock for the recorder, which Run calls before it returns.
  CopyPipeline* const pipeline = pipeline_.get();
  const absl::Span<const BufferCopy> copies = pending_copies_;
  const absl::Status status = runner_->Run([&](const vk::raii::CommandBuffer& commands) {
    return RecordPending(commands, pipeline, copies);
  });
  if (status.ok()) {
    for (const PendingRead& read : pending_reads_) {
      std::memcpy(read.dst, ring_->data() + read.ring_offset, read.bytes);
    }
  }
  pending_copies_.clear();
  pending_reads_.clear();
  ring_->Reset();
  return status;
}

absl::Status StagedTransfer::RecordPending(const vk::raii::CommandBuffer& commands,
                                           CopyPipeline* pipeline,
                                           absl::Span<const BufferCopy> copies) const {
  if (engine_ == CopyEngine::kComputeShader) return pipeline->Record(commands, copies);
  RecordCopyRegions(commands, copies);
  return absl::OkStatus();
}

}  // namespace kvcache::gpu
