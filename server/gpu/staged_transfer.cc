#include "gpu/staged_transfer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/status_macros.h"
#include "gpu/command_runner.h"
#include "gpu/staging.h"

namespace kvcache::gpu {

// One ring, command buffer and fence; its calls take turns.
class StagedTransfer::Lane {
 public:
  static absl::StatusOr<std::unique_ptr<Lane>> Create(const Device& device, CopyEngine engine,
                                                      uint64_t ring_bytes);

  absl::Status Write(absl::Span<const HostToDevice> writes);
  absl::Status Read(absl::Span<const DeviceToHost> reads);
  absl::Status Copy(absl::Span<const BufferCopy> copies);

  // Calls that hold or wait for this lane.
  std::atomic<uint32_t> users{0};

 private:
  // Bytes waiting in the ring for a Read's submission to finish.
  struct PendingRead {
    uint64_t ring_offset;
    std::byte* dst;
    uint64_t bytes;
  };

  Lane(CopyEngine engine, std::unique_ptr<StagingRing> ring, std::unique_ptr<CommandRunner> runner,
       std::unique_ptr<CopyPipeline> pipeline)
      : engine_(engine),
        ring_(std::move(ring)),
        runner_(std::move(runner)),
        pipeline_(std::move(pipeline)) {}
  // Ring space for up to `bytes` bytes of a device range starting at
  // `device_offset`, submitting what is pending first when full.
  absl::StatusOr<StagingRing::Slice> Reserve(uint64_t device_offset, uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Submits the pending copies, waits, delivers pending reads, empties the ring.
  absl::Status Flush() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Records `copies` through `pipeline` (kComputeShader) or as copy regions.
  absl::Status RecordPending(const vk::raii::CommandBuffer& commands, CopyPipeline* pipeline,
                             absl::Span<const BufferCopy> copies) const;

  const CopyEngine engine_;
  absl::Mutex mutex_;
  std::unique_ptr<StagingRing> ring_ ABSL_GUARDED_BY(mutex_);
  std::unique_ptr<CommandRunner> runner_ ABSL_GUARDED_BY(mutex_);
  std::unique_ptr<CopyPipeline> pipeline_ ABSL_GUARDED_BY(mutex_);  // kComputeShader only
  std::vector<BufferCopy> pending_copies_ ABSL_GUARDED_BY(mutex_);
  std::vector<PendingRead> pending_reads_ ABSL_GUARDED_BY(mutex_);
};

// A lane held for one call: one that no call holds where there is one (taken
// by moving its count from 0 to 1, so two calls never both take it), else
// the lanes in turn.
class StagedTransfer::Claim {
 public:
  explicit Claim(StagedTransfer& transfer) : lane_(Take(transfer)) {}
  ~Claim() { lane_.users.fetch_sub(1, std::memory_order_release); }
  Claim(const Claim&) = delete;
  Claim& operator=(const Claim&) = delete;
  Lane* operator->() const { return &lane_; }

 private:
  static Lane& Take(StagedTransfer& transfer) {
    for (const std::unique_ptr<Lane>& lane : transfer.lanes_) {
      uint32_t idle = 0;
      if (lane->users.compare_exchange_strong(idle, 1, std::memory_order_acquire)) return *lane;
    }
    const size_t turn = transfer.turn_.fetch_add(1, std::memory_order_relaxed);
    Lane& lane = *transfer.lanes_[turn % transfer.lanes_.size()];
    lane.users.fetch_add(1, std::memory_order_acquire);
    return lane;
  }
  Lane& lane_;
};

absl::StatusOr<std::unique_ptr<StagedTransfer>> StagedTransfer::Create(const Device& device,
                                                                       CopyEngine engine,
                                                                       uint64_t ring_bytes) {
  const size_t count = std::clamp<uint64_t>(ring_bytes / kMinLaneBytes, 1, kMaxLanes);
  std::vector<std::unique_ptr<Lane>> lanes;
  for (size_t i = 0; i < count; ++i) {
    ASSIGN_OR_RETURN(std::unique_ptr<Lane> lane, Lane::Create(device, engine, ring_bytes / count));
    lanes.push_back(std::move(lane));
  }
  return std::unique_ptr<StagedTransfer>(new StagedTransfer(std::move(lanes)));
}

StagedTransfer::StagedTransfer(std::vector<std::unique_ptr<Lane>> lanes)
    : lanes_(std::move(lanes)) {}

StagedTransfer::~StagedTransfer() = default;

absl::Status StagedTransfer::Write(absl::Span<const HostToDevice> writes) {
  return Claim(*this)->Write(writes);
}

absl::Status StagedTransfer::Read(absl::Span<const DeviceToHost> reads) {
  return Claim(*this)->Read(reads);
}

absl::Status StagedTransfer::Copy(absl::Span<const BufferCopy> copies) {
  return Claim(*this)->Copy(copies);
}

absl::StatusOr<std::unique_ptr<StagedTransfer::Lane>> StagedTransfer::Lane::Create(
    const Device& device, CopyEngine engine, uint64_t ring_bytes) {
  ASSIGN_OR_RETURN(std::unique_ptr<StagingRing> ring, StagingRing::Create(device, ring_bytes));
  ASSIGN_OR_RETURN(std::unique_ptr<CommandRunner> runner, CommandRunner::Create(device));
  std::unique_ptr<CopyPipeline> pipeline;
  if (engine == CopyEngine::kComputeShader) {
    ASSIGN_OR_RETURN(pipeline, CopyPipeline::Create(device));
  }
  return std::unique_ptr<Lane>(
      new Lane(engine, std::move(ring), std::move(runner), std::move(pipeline)));
}

absl::Status StagedTransfer::Lane::Write(absl::Span<const HostToDevice> writes) {
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

absl::Status StagedTransfer::Lane::Read(absl::Span<const DeviceToHost> reads) {
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

absl::Status StagedTransfer::Lane::Copy(absl::Span<const BufferCopy> copies) {
  absl::MutexLock lock(&mutex_);
  for (const BufferCopy& copy : copies) {
    if (pending_copies_.size() == CopyPipeline::kMaxCopies) RETURN_IF_ERROR(Flush());
    pending_copies_.push_back(copy);
  }
  return Flush();
}

absl::StatusOr<StagingRing::Slice> StagedTransfer::Lane::Reserve(uint64_t device_offset,
                                                                 uint64_t bytes) {
  if (pending_copies_.size() < CopyPipeline::kMaxCopies) {
    const StagingRing::Slice slice = ring_->Reserve(bytes, device_offset % 4);
    if (slice.bytes > 0) return slice;
  }
  RETURN_IF_ERROR(Flush());
  return ring_->Reserve(bytes, device_offset % 4);  // The empty ring always has room.
}

absl::Status StagedTransfer::Lane::Flush() {
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

absl::Status StagedTransfer::Lane::RecordPending(const vk::raii::CommandBuffer& commands,
                                                 CopyPipeline* pipeline,
                                                 absl::Span<const BufferCopy> copies) const {
  if (engine_ == CopyEngine::kComputeShader) return pipeline->Record(commands, copies);
  RecordCopyRegions(commands, copies);
  return absl::OkStatus();
}

}  // namespace kvcache::gpu
