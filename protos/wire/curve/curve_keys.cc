#include "wire/curve/curve_keys.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvcache::curve {
namespace {

constexpr size_t kZ85KeyChars = 40;
constexpr size_t kKeyBytes = 32;
// A key file is a key and a newline; a list, keys: nothing near this long.
constexpr off_t kMostFileBytes = 1 << 20;

enum class Sharing { kOwnerOnly, kOthersMayRead };

// The file at `path`, opened without following a symbolic link; checked on
// the opened file: regular, within kMostFileBytes, and as private as
// `sharing` says (others may never write it). It is this user's, or root's
// (as Kubernetes and systemd mount secrets: root's, group-readable by the
// service's group), where a secret key may be read by its group too, as
// PostgreSQL allows for its key files.
absl::StatusOr<std::string> ReadCheckedFile(const std::string& path, absl::string_view flag,
                                            Sharing sharing) {
  const auto refused = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": \"", path, "\" ", why));
  };
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return refused(absl::StrCat("cannot be opened: ", std::strerror(errno)));
  absl::Cleanup close_fd = [fd] { close(fd); };
  struct stat info;
  if (fstat(fd, &info) != 0) return refused(absl::StrCat("cannot be read: ", std::strerror(errno)));
  if (!S_ISREG(info.st_mode)) return refused("is not a regular file");
  const bool mine = info.st_uid == geteuid();
  if (!mine && info.st_uid != 0) return refused("belongs to another user (not this one, not root)");
  mode_t closed = S_IWGRP | S_IWOTH;
  if (sharing == Sharing::kOwnerOnly) closed = mine ? (S_IRWXG | S_IRWXO) : (S_IWGRP | S_IRWXO);
  if ((info.st_mode & closed) != 0) {
    return refused(sharing == Sharing::kOwnerOnly
                       ? "is open to other users; a secret key must be readable by its owner "
                         "only (chmod 600; a root-owned one may be read by its group: 640)"
                       : "may be written by other users, who could list themselves (chmod 644)");
  }
  if (info.st_size > kMostFileBytes) return refused("is too large for keys");
  std::string text(static_cast<size_t>(info.st_size), '\0');
  size_t read_bytes = 0;
  while (read_bytes < text.size()) {
    const ssize_t got = read(fd, text.data() + read_bytes, text.size() - read_bytes);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return refused(absl::StrCat("cannot be read: ", std::strerror(errno)));
    read_bytes += static_cast<size_t>(got);
  }
  return text;
}

}  // namespace

absl::Status CheckKey(absl::string_view key, absl::string_view what) {
  if (!DecodeKey(key).has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a CURVE key (40 Z85 characters, as curve_keygen prints)"));
  }
  return absl::OkStatus();
}

std::optional<std::string> DecodeKey(absl::string_view key) {
  if (key.size() != kZ85KeyChars) return std::nullopt;
  const std::string text(key);
  std::string bytes(kKeyBytes, '\0');
  if (zmq_z85_decode(reinterpret_cast<uint8_t*>(bytes.data()), text.c_str()) == nullptr) {
    return std::nullopt;
  }
  return bytes;
}

std::string EncodeKey(absl::string_view bytes) {
  if (bytes.size() != kKeyBytes) return "";
  char text[kZ85KeyChars + 1];
  if (zmq_z85_encode(text, reinterpret_cast<const uint8_t*>(bytes.data()), kKeyBytes) == nullptr) {
    return "";
  }
  return text;
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
  absl::StatusOr<std::string> text = ReadCheckedFile(path, flag, Sharing::kOwnerOnly);
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
  absl::StatusOr<std::string> text = ReadCheckedFile(path, flag, Sharing::kOthersMayRead);
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
