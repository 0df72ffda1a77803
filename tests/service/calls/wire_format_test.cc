// The Fetch chunk framing written by hand (service/calls/fetch_call.h): whatever
// fields a chunk's header holds, those of the schema today and any added
// later, the framed chunk reads back through protobuf whole.
#include "service/calls/fetch_call.h"

#include <google/protobuf/util/message_differencer.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "support/schema_fields.h"

namespace kvcache::testing {
namespace {

using ::testing::IsEmpty;

// `header` framed with `keys` and `values` as the data, as one string.
std::string Framed(const v1::FetchResponse& header, const std::string& keys,
                   const std::string& values) {
  const service::FetchChunkFraming framing(header, keys.size(), values.size());
  std::string wire(framing.size(), '\0');
  framing.Write(reinterpret_cast<uint8_t*>(wire.data()));
  wire.replace(framing.keys_offset(), keys.size(), keys);
  wire.replace(framing.values_offset(), values.size(), values);
  // The lane sends it as head, keys, middle, values: the same bytes.
  const auto text = [](absl::Span<const std::byte> bytes) {
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  };
  EXPECT_EQ(text(framing.head()) + keys + text(framing.middle()) + values, wire);
  return wire;
}

// Every field of FetchResponse and of the messages in it is set (found by
// walking the descriptor, so a field added to the schema is set too).
TEST(FetchChunkFramingTest, KeepsEveryFieldTheSchemaHas) {
  const FieldsByMessage all = AllFields(*v1::FetchResponse::descriptor());
  v1::FetchResponse expected;
  FillHandledFields(all, expected);
  expected.mutable_keys()->set_data(std::string(300, 'k'));
  expected.mutable_values()->set_data(std::string(70, 'v'));
  v1::FetchResponse header = expected;
  header.mutable_keys()->clear_data();
  header.mutable_values()->clear_data();

  v1::FetchResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(Framed(header, expected.keys().data(),
                                            expected.values().data())));
  EXPECT_THAT(UnsetHandledFields(all, parsed), IsEmpty());
  std::string differences;
  google::protobuf::util::MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&differences);
  EXPECT_TRUE(differencer.Compare(expected, parsed)) << differences;
}

// A plain chunk of keys and values comes out as protobuf's own bytes.
TEST(FetchChunkFramingTest, APlainChunkIsProtobufsEncoding) {
  v1::FetchResponse chunk;
  chunk.set_layer(3);
  chunk.set_start(1 << 20);
  for (v1::Tensor* tensor : {chunk.mutable_keys(), chunk.mutable_values()}) {
    tensor->set_dtype(v1::DTYPE_FLOAT16);
    for (uint64_t d : {1, 2, 5, 64}) tensor->add_shape(d);
  }
  const std::string keys(1 * 2 * 5 * 64 * 2, 'k'), values(1 * 2 * 5 * 64 * 2, 'v');
  const std::string wire = Framed(chunk, keys, values);
  chunk.mutable_keys()->set_data(keys);
  chunk.mutable_values()->set_data(values);
  EXPECT_EQ(wire, chunk.SerializeAsString());
}

}  // namespace
}  // namespace kvcache::testing
