#include "service/calls/fetch_call.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

#include <algorithm>
#include <utility>

namespace kvcache::service {
namespace {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

constexpr auto kLengthDelimited = WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
// Field numbers of kvcache.v1.FetchResponse and kvcache.v1.Tensor.
// The fields written by hand; the rest go through protobuf's serialiser.
constexpr int kFetchKeys = v1::FetchResponse::kKeysFieldNumber;
constexpr int kFetchValues = v1::FetchResponse::kValuesFieldNumber;
constexpr int kTensorData = v1::Tensor::kDataFieldNumber;

// Bytes of a length-delimited field's tag and length prefix.
size_t PrefixSize(int field, uint64_t length) {
  return CodedOutputStream::VarintSize32(WireFormatLite::MakeTag(field, kLengthDelimited)) +
         CodedOutputStream::VarintSize64(length);
}

uint8_t* WritePrefix(int field, uint64_t length, uint8_t* out) {
  out = WireFormatLite::WriteTagToArray(field, kLengthDelimited, out);
  return CodedOutputStream::WriteVarint64ToArray(length, out);
}

// A Tensor's encoding: its dtype and shape, then its data's prefix; the data
// itself follows.
std::string TensorHeader(const v1::Tensor& tensor, uint64_t data_bytes) {
  std::string header = tensor.SerializeAsString();
  const size_t at = header.size();
  header.resize(at + PrefixSize(kTensorData, data_bytes));
  WritePrefix(kTensorData, data_bytes, reinterpret_cast<uint8_t*>(header.data() + at));
  return header;
}

}  // namespace

FetchChunkFraming::FetchChunkFraming(const v1::FetchResponse& header, uint64_t key_bytes,
                                     uint64_t value_bytes)
    : key_bytes_(key_bytes), value_bytes_(value_bytes) {
  v1::FetchResponse scalars = header;
  scalars.clear_keys();
  scalars.clear_values();
  const std::string keys = TensorHeader(header.keys(), key_bytes);
  const std::string values = TensorHeader(header.values(), value_bytes);
  const uint64_t keys_size = keys.size() + key_bytes;
  const uint64_t values_size = values.size() + value_bytes;
  head_ = scalars.SerializeAsString();
  size_t at = head_.size();
  head_.resize(at + PrefixSize(kFetchKeys, keys_size));
  WritePrefix(kFetchKeys, keys_size, reinterpret_cast<uint8_t*>(head_.data() + at));
  head_ += keys;
  middle_.resize(PrefixSize(kFetchValues, values_size));
  WritePrefix(kFetchValues, values_size, reinterpret_cast<uint8_t*>(middle_.data()));
  middle_ += values;
  keys_offset_ = head_.size();
  values_offset_ = keys_offset_ + key_bytes + middle_.size();
  size_ = values_offset_ + value_bytes;
}

void FetchChunkFraming::Write(uint8_t* out) const {
  std::copy(head_.begin(), head_.end(), out);
  std::copy(middle_.begin(), middle_.end(), out + keys_offset_ + key_bytes_);
}

FetchCall::FetchCall(Handlers& handlers, const absl::StatusOr<v1::FetchRequest>& request,
                     const Admitted* caller)
    : handlers_(handlers), caller_(caller) {
  absl::Status admitted = caller_ != nullptr ? caller_->StillAdmitted() : absl::OkStatus();
  absl::StatusOr<FetchPlan> plan = !admitted.ok()  ? absl::StatusOr<FetchPlan>(admitted)
                                   : request.ok() ? handlers_.PlanFetch(*request)
                                                  : absl::StatusOr<FetchPlan>(request.status());
  if (!plan.ok()) {
    status_ = plan.status();
    return;
  }
  plan_ = *std::move(plan);
  framings_.resize(plan_.chunks.size());
}

bool FetchCall::has_next() {
  if (!pending()) return false;
  if (caller_ != nullptr) {
    if (absl::Status admitted = caller_->StillAdmitted(); !admitted.ok()) {
      (void)Fail(admitted);
      return false;
    }
  }
  return true;
}

bool FetchCall::next_is_tokens() const {
  return pending() && plan_.chunks[next_].form == FetchPlan::Form::kTokens;
}

const FetchChunkFraming& FetchCall::FramingAt(size_t index) {
  std::optional<FetchChunkFraming>& framing = framings_[index];
  if (!framing.has_value()) {
    v1::FetchResponse header;
    uint64_t key_bytes = 0, value_bytes = 0;
    handlers_.FetchChunkHeader(plan_, index, &header, &key_bytes, &value_bytes);
    framing.emplace(header, key_bytes, value_bytes);
  }
  return *framing;
}

std::optional<uint64_t> FetchCall::TokenChunksBytes(uint64_t framing_bytes) {
  if (!status_.ok()) return std::nullopt;
  uint64_t bytes = 0;
  for (size_t index = next_; index < plan_.chunks.size(); ++index) {
    if (plan_.chunks[index].form != FetchPlan::Form::kTokens) return std::nullopt;
    bytes += framing_bytes + FramingAt(index).size();
  }
  return bytes;
}

const FetchChunkFraming& FetchCall::NextFraming() { return FramingAt(next_); }

bool FetchCall::MappedNext(engine::KvMappedPieces& out) {
  if (!handlers_.MappedFetchChunk(plan_, next_, out).ok()) return false;
  ++next_;
  return true;
}

absl::Status FetchCall::ReadNext(absl::Span<std::byte> out) {
  const FetchChunkFraming& framing = FramingAt(next_);
  framing.Write(reinterpret_cast<uint8_t*>(out.data()));
  const engine::KvOutput data{
      .keys = out.subspan(framing.keys_offset(), framing.key_bytes()),
      .values = out.subspan(framing.values_offset(), framing.value_bytes())};
  const absl::Status read = handlers_.ReadFetchChunk(plan_, next_++, data);
  return read.ok() ? read : Fail(read);
}

absl::Status FetchCall::FillNext(v1::FetchResponse& out) {
  const absl::Status filled = handlers_.FillFetchChunk(plan_, next_++, &out);
  return filled.ok() ? filled : Fail(filled);
}

absl::Status FetchCall::Fail(absl::Status status) {
  if (status_.ok()) status_ = status;
  return status;
}

absl::Status FetchCall::Finish(const absl::Status& transport) {
  plan_ = FetchPlan();  // its frozen snapshot holds the pages' references
  framings_.clear();
  next_ = 0;
  if (status_.ok()) status_ = transport;
  return status_;
}

}  // namespace kvcache::service
