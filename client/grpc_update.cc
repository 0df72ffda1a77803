// An UpdateStream's gRPC call: requests encoded by hand (update_encoding.h),
// acknowledgements read by a thread of the stream's own.
#include <grpcpp/grpcpp.h>

#include <thread>

#include "update_encoding.h"
#include "update_transport.h"

namespace kvcache::internal {
namespace {

class GrpcUpdate final : public UpdateTransport {
 public:
  GrpcUpdate(grpc::ChannelInterface& channel, const grpc::internal::RpcMethod& method,
             std::string cache_id, absl::Duration deadline)
      : cache_id_(std::move(cache_id)) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    // The generated stub's own factory, with requests that are already encoded.
    stream_.reset(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, v1::UpdateResponse>::
                      Create(&channel, method, &context_));
    reader_ = std::thread([this] {
      v1::UpdateResponse ack;
      while (stream_->Read(&ack)) AddAck(ack);
    });
  }

  bool Write(const LayerUpdate& update, const std::shared_ptr<const void>* owner) override {
    return stream_->Write(owner == nullptr ? EncodeUpdateCopy(cache_id_, update)
                                           : EncodeUpdateShared(cache_id_, update, *owner));
  }

  absl::Status Finish() override {
    stream_->WritesDone();
    reader_.join();
    const grpc::Status status = stream_->Finish();
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        status.error_message());
  }

  void Cancel() override { context_.TryCancel(); }

 private:
  std::string cache_id_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, v1::UpdateResponse>> stream_;
  std::thread reader_;
};

}  // namespace

std::unique_ptr<UpdateTransport> OpenGrpcUpdate(grpc::ChannelInterface& channel,
                                                const grpc::internal::RpcMethod& method,
                                                std::string cache_id, absl::Duration deadline) {
  return std::make_unique<GrpcUpdate>(channel, method, std::move(cache_id), deadline);
}

}  // namespace kvcache::internal
