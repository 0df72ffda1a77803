#include "gpu/host_quantizer.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "gpu/host_workers.h"
#include "gpu/quantizer.h"

namespace kvcache::gpu {
namespace {

// Calls with at least this much input (quantize) or output (dequantize) are
// shared out among the HostWorkers: a decode step's few rows stay on the
// calling thread, a prefill's megabytes use every core.
constexpr uint64_t kParallelBytes = 256 << 10;

// Rows of a tensor given as pieces that read as their concatenation.
class PiecedRows {
 public:
  PiecedRows(absl::Span<const absl::Span<const std::byte>> pieces, uint64_t row_bytes)
      : pieces_(pieces), row_bytes_(row_bytes) {
    uint64_t start = 0;
    for (const auto& piece : pieces) {
      starts_.push_back(start);
      start += piece.size();
    }
  }

  // Calls visit(rows_ptr, first, count) for consecutive spans that cover rows
  // [first, first + rows), each contiguous in memory. Thread-safe: a row that
  // straddles two pieces is gathered into a buffer of the call's own.
  template <typename Visit>
  void ForEachSpan(uint64_t first, uint64_t rows, Visit&& visit) const {
    std::vector<std::byte> row;
    while (rows > 0) {
      const uint64_t at = first * row_bytes_;
      const size_t p = PieceOf(at);
      const uint64_t in_piece = at - starts_[p];
      const uint64_t whole = std::min(rows, (pieces_[p].size() - in_piece) / row_bytes_);
      if (whole > 0) {
        visit(pieces_[p].data() + in_piece, first, whole);
      } else {
        row.resize(row_bytes_);
        Gather(p, in_piece, row.data());
        visit(row.data(), first, uint64_t{1});
      }
      const uint64_t done = std::max<uint64_t>(whole, 1);
      first += done;
      rows -= done;
    }
  }

 private:
  // The piece holding byte `at` (empty pieces never hold one).
  size_t PieceOf(uint64_t at) const {
    const auto after = std::upper_bound(starts_.begin(), starts_.end(), at);
    size_t p = static_cast<size_t>(after - starts_.begin()) - 1;
    while (pieces_[p].empty()) ++p;
    return p;
  }
  // One row from piece p at byte `offset` on, across the following pieces.
  void Gather(size_t p, uint64_t offset, std::byte* row) const {
    for (uint64_t filled = 0; filled < row_bytes_; ++p, offset = 0) {
      const uint64_t take = std::min(row_bytes_ - filled, pieces_[p].size() - offset);
      std::memcpy(row + filled, pieces_[p].data() + offset, take);
      filled += take;
    }
  }

  absl::Span<const absl::Span<const std::byte>> pieces_;
  const uint64_t row_bytes_;
  std::vector<uint64_t> starts_;
};

// Where row `row` of `run` lies in its page's planes.
QuantPlanes PlanesAt(const PageAllocator& pages, const QuantFormat& f, const QuantRun& run,
                     uint64_t row) {
  std::byte* host = pages.Locate(run.page).host;
  const uint64_t skipped = row - run.first_row;
  return {host + run.wq_offset + skipped * f.wq_row_bytes(),
          host + run.scales_offset + skipped * f.scale_row_bytes(),
          host + run.biases_offset + skipped * f.scale_row_bytes()};
}

// Calls work(job, run) for every run of `jobs`: on this thread alone for
// small calls, shared with the HostWorkers for large ones.
template <typename Job, typename Work>
void ForEachRun(absl::Span<const Job> jobs, uint64_t call_bytes, Work&& work) {
  if (call_bytes < kParallelBytes) {
    for (size_t j = 0; j < jobs.size(); ++j) {
      for (size_t r = 0; r < jobs[j].runs.size(); ++r) work(j, r);
    }
    return;
  }
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t j = 0; j < jobs.size(); ++j) {
    for (size_t r = 0; r < jobs[j].runs.size(); ++r) runs.emplace_back(j, r);
  }
  HostWorkers::Shared().ParallelFor(runs.size(), [&](size_t i) {
    work(runs[i].first, runs[i].second);
  });
}

}  // namespace

void QuantizeOnHost(QuantIsa isa, const PageAllocator& pages, absl::Span<const QuantizeJob> jobs) {
  std::vector<PiecedRows> inputs;
  uint64_t call_bytes = 0;
  for (const QuantizeJob& job : jobs) {
    inputs.emplace_back(job.input, job.format.row_bytes());
    for (const QuantRun& run : job.runs) call_bytes += run.rows * job.format.row_bytes();
  }
  ForEachRun(jobs, call_bytes, [&](size_t j, size_t r) {
    const QuantFormat& f = jobs[j].format;
    const QuantRun& run = jobs[j].runs[r];
    inputs[j].ForEachSpan(run.first_row, run.rows,
                          [&](const std::byte* values, uint64_t first, uint64_t rows) {
                            QuantizeGroups(isa, f, values, rows * (f.dim / f.group_size),
                                           PlanesAt(pages, f, run, first));
                          });
  });
}

void DequantizeOnHost(QuantIsa isa, const PageAllocator& pages,
                      absl::Span<const DequantizeJob> jobs) {
  uint64_t call_bytes = 0;
  for (const DequantizeJob& job : jobs) call_bytes += job.output.size();
  ForEachRun(jobs, call_bytes, [&](size_t j, size_t r) {
    const QuantFormat& f = jobs[j].format;
    const QuantRun& run = jobs[j].runs[r];
    const QuantPlanes planes = PlanesAt(pages, f, run, run.first_row);
    DequantizeGroups(isa, f, {planes.wq, planes.scales, planes.biases},
                     run.rows * (f.dim / f.group_size),
                     jobs[j].output.data() + run.first_row * f.row_bytes());
  });
}

}  // namespace kvcache::gpu
