#include "support/schema_fields.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"

namespace kvcache::testing {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

const std::vector<int>& ListFor(const FieldsByMessage& lists, const std::string& message) {
  static const std::vector<int> kNone;
  const auto it = lists.find(message);
  return it == lists.end() ? kNone : it->second;
}

bool Lists(const std::vector<int>& fields, int number) {
  return std::find(fields.begin(), fields.end(), number) != fields.end();
}

std::string FieldName(const FieldDescriptor& field) {
  return absl::StrCat(field.full_name(), " = ", field.number());
}

class SchemaWalk {
 public:
  SchemaWalk(const FieldsByMessage& handled, const FieldsByMessage& left)
      : handled_(handled), left_(left) {}

  void Visit(const Descriptor& message) {
    if (!visited_.insert(message.full_name()).second) return;
    if (handled_.count(message.full_name()) == 0) {
      findings_.push_back(absl::StrCat(message.full_name(), ": reached, but no fields listed"));
      return;
    }
    const std::vector<int>& handled = ListFor(handled_, message.full_name());
    const std::vector<int>& left = ListFor(left_, message.full_name());
    for (int i = 0; i < message.field_count(); ++i) {
      const FieldDescriptor& field = *message.field(i);
      const bool is_handled = Lists(handled, field.number());
      const bool is_left = Lists(left, field.number());
      if (!is_handled && !is_left) {
        findings_.push_back(absl::StrCat(FieldName(field), ": in the schema, not declared"));
      } else if (is_handled && is_left) {
        findings_.push_back(absl::StrCat(FieldName(field), ": both handled and left to protobuf"));
      } else if (is_handled && field.message_type() != nullptr) {
        Visit(*field.message_type());
      }
    }
    for (const std::vector<int>* list : {&handled, &left}) {
      for (int number : *list) {
        if (message.FindFieldByNumber(number) == nullptr) {
          findings_.push_back(
              absl::StrCat(message.full_name(), ": declares ", number, ", not in the schema"));
        }
      }
    }
  }

  std::vector<std::string> findings() && { return std::move(findings_); }

 private:
  const FieldsByMessage& handled_;
  const FieldsByMessage& left_;
  std::set<std::string> visited_;
  std::vector<std::string> findings_;
};

// Sets (or, for a repeated field, adds) a value other than the default;
// `index` tells a repeated field's values apart.
void SetValue(const FieldsByMessage& handled, const FieldDescriptor& field, int index,
              Message& message) {
  const Reflection& r = *message.GetReflection();
  const bool repeated = field.is_repeated();
  const int number = 7 + index;
  const std::string text = absl::StrCat("v", number);
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return repeated ? r.AddInt32(&message, &field, number) : r.SetInt32(&message, &field, number);
    case FieldDescriptor::CPPTYPE_INT64:
      return repeated ? r.AddInt64(&message, &field, number) : r.SetInt64(&message, &field, number);
    case FieldDescriptor::CPPTYPE_UINT32:
      return repeated ? r.AddUInt32(&message, &field, number)
                      : r.SetUInt32(&message, &field, number);
    case FieldDescriptor::CPPTYPE_UINT64:
      return repeated ? r.AddUInt64(&message, &field, number)
                      : r.SetUInt64(&message, &field, number);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return repeated ? r.AddDouble(&message, &field, number)
                      : r.SetDouble(&message, &field, number);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return repeated ? r.AddFloat(&message, &field, number) : r.SetFloat(&message, &field, number);
    case FieldDescriptor::CPPTYPE_BOOL:
      return repeated ? r.AddBool(&message, &field, true) : r.SetBool(&message, &field, true);
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* last = field.enum_type()->value(field.enum_type()->value_count() - 1);
      return repeated ? r.AddEnum(&message, &field, last) : r.SetEnum(&message, &field, last);
    }
    case FieldDescriptor::CPPTYPE_STRING:
      return repeated ? r.AddString(&message, &field, text) : r.SetString(&message, &field, text);
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return FillHandledFields(handled, repeated ? *r.AddMessage(&message, &field)
                                                 : *r.MutableMessage(&message, &field));
  }
}

void CollectUnset(const FieldsByMessage& handled, const Message& message,
                  std::vector<std::string>& unset) {
  const Descriptor& descriptor = *message.GetDescriptor();
  const Reflection& r = *message.GetReflection();
  for (int number : ListFor(handled, descriptor.full_name())) {
    const FieldDescriptor* field = descriptor.FindFieldByNumber(number);
    if (field == nullptr) continue;
    const int count = field->is_repeated() ? r.FieldSize(message, field)
                                           : (r.HasField(message, field) ? 1 : 0);
    if (count == 0) unset.push_back(FieldName(*field));
    if (field->message_type() == nullptr) continue;
    for (int i = 0; i < count; ++i) {
      CollectUnset(handled,
                   field->is_repeated() ? r.GetRepeatedMessage(message, field, i)
                                        : r.GetMessage(message, field),
                   unset);
    }
  }
}

}  // namespace

std::vector<std::string> UndeclaredFields(const Descriptor& root, const FieldsByMessage& handled,
                                          const FieldsByMessage& left_to_protobuf) {
  SchemaWalk walk(handled, left_to_protobuf);
  walk.Visit(root);
  return std::move(walk).findings();
}

FieldsByMessage AllFields(const Descriptor& root) {
  FieldsByMessage all;
  std::vector<const Descriptor*> pending = {&root};
  while (!pending.empty()) {
    const Descriptor& message = *pending.back();
    pending.pop_back();
    if (all.count(message.full_name()) != 0) continue;
    std::vector<int>& fields = all[message.full_name()];
    for (int i = 0; i < message.field_count(); ++i) {
      fields.push_back(message.field(i)->number());
      if (message.field(i)->message_type() != nullptr) {
        pending.push_back(message.field(i)->message_type());
      }
    }
  }
  return all;
}

void FillHandledFields(const FieldsByMessage& handled, Message& message) {
  const Descriptor& descriptor = *message.GetDescriptor();
  for (int number : ListFor(handled, descriptor.full_name())) {
    const FieldDescriptor* field = descriptor.FindFieldByNumber(number);
    if (field == nullptr) continue;
    for (int i = 0; i < (field->is_repeated() ? 2 : 1); ++i) SetValue(handled, *field, i, message);
  }
}

std::vector<std::string> UnsetHandledFields(const FieldsByMessage& handled,
                                            const Message& message) {
  std::vector<std::string> unset;
  CollectUnset(handled, message, unset);
  return unset;
}

}  // namespace kvcache::testing
