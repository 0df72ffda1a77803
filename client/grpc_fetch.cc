// Fetch over gRPC: chunks read by the generated stub into one FetchResponse,
// handed on without a copy.
#include <grpcpp/grpcpp.h>

#include "fetch_transport.h"

namespace kvcache::internal {
namespace {

// A chunk gRPC has parsed already.
class ParsedChunk final : public ReceivedChunk {
 public:
  v1::FetchResponse& message() { return message_; }

  absl::Status Take(v1::FetchResponse& out) override {
    out.Swap(&message_);
    return absl::OkStatus();
  }

  absl::Status View(v1::FetchResponse& header, FetchChunkView& out) override {
    header.Swap(&message_);
    out = {.header = &header, .keys = BytesOf(header.keys().data()),
           .values = BytesOf(header.values().data())};
    return absl::OkStatus();
  }

 private:
  v1::FetchResponse message_;
};

class GrpcFetch final : public FetchTransport {
 public:
  GrpcFetch(v1::KvCacheService::Stub& stub, absl::Duration deadline)
      : stub_(stub), deadline_(deadline) {}

  absl::Status Fetch(const v1::FetchRequest& request, const ChunkSink& on_chunk) override {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline_));
    auto reader = stub_.Fetch(&context, request);
    ParsedChunk chunk;
    absl::Status sink_status;
    while (reader->Read(&chunk.message())) {
      sink_status = on_chunk(chunk);
      if (!sink_status.ok()) {
        context.TryCancel();
        break;
      }
    }
    const grpc::Status status = reader->Finish();
    if (!sink_status.ok()) return sink_status;
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        status.error_message());
  }

 private:
  v1::KvCacheService::Stub& stub_;
  const absl::Duration deadline_;
};

}  // namespace

std::unique_ptr<FetchTransport> GrpcFetchTransport(v1::KvCacheService::Stub& stub,
                                                   absl::Duration deadline) {
  return std::make_unique<GrpcFetch>(stub, deadline);
}

}  // namespace kvcache::internal
