#include "curve/curve_keys.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvcache::curve {
namespace {

constexpr size_t kZ85KeyChars = 40;

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::ifstream file(path);
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read \"", path, "\": ", std::strerror(errno)));
  }
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

}  // namespace

absl::Status CheckKey(absl::string_view key, absl::string_view what) {
  uint8_t bytes[32];
  const std::string text(key);
  if (key.size() != kZ85KeyChars || zmq_z85_decode(bytes, text.c_str()) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a CURVE key (40 Z85 characters, as curve_keygen prints)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<KeyPair> NewKeyPair() {
  char public_key[kZ85KeyChars + 1];
  char secret_key[kZ85KeyChars + 1];
  if (zmq_curve_keypair(public_key, secret_key) != 0) {
    return absl::InternalError(
        absl::StrCat("no CURVE keys: libzmq says ", zmq_strerror(zmq_errno())));
  }
  return KeyPair{.public_key = public_key, .secret_key = secret_key};
}

absl::StatusOr<KeyPair> ReadSecretKeyFile(const std::string& path, absl::string_view flag) {
  struct stat info;
  if (stat(path.c_str(), &info) == 0 && (info.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path,
                     "\" is open to other users; a secret key must be readable by its owner "
                     "only (chmod 600)"));
  }
  absl::StatusOr<std::string> text = ReadFile(path, flag);
  if (!text.ok()) return text.status();
  KeyPair pair{.secret_key = std::string(absl::StripAsciiWhitespace(*text))};
  if (absl::Status valid = CheckKey(pair.secret_key, flag); !valid.ok()) return valid;
  char public_key[kZ85KeyChars + 1];
  if (zmq_curve_public(public_key, pair.secret_key.c_str()) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": no public key follows from it: ", zmq_strerror(zmq_errno())));
  }
  pair.public_key = public_key;
  return pair;
}

absl::StatusOr<std::vector<std::string>> ReadPublicKeysFile(const std::string& path,
                                                            absl::string_view flag) {
  absl::StatusOr<std::string> text = ReadFile(path, flag);
  if (!text.ok()) return text.status();
  std::vector<std::string> keys;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    if (absl::Status valid = CheckKey(line, absl::StrCat(flag, " line ", number)); !valid.ok()) {
      return valid;
    }
    keys.emplace_back(line);
  }
  if (keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": \"", path, "\" lists no key"));
  }
  return keys;
}

absl::Status WriteSecretKeyFile(const std::string& path, absl::string_view secret_key) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const std::string why = absl::StrCat("\"", path, "\": ", std::strerror(errno));
    return errno == EEXIST ? absl::AlreadyExistsError(why) : absl::InvalidArgumentError(why);
  }
  const std::string line = absl::StrCat(secret_key, "\n");
  const bool written = write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  const bool closed = close(fd) == 0;
  if (!written || !closed) {
    return absl::InternalError(absl::StrCat("\"", path, "\": cannot write it"));
  }
  return absl::OkStatus();
}

}  // namespace kvcache::curve
