// ZeroMQ CURVE keys (libzmq's CurveZMQ: Curve25519 key exchange, each
// message encrypted and authenticated) as operators keep them: Z85 text of
// 40 characters, the form libzmq's curve_keygen prints. A secret key lives
// in a file of its own (readable by its owner alone); public keys are
// handed around, an allow-list of them one per line.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache::curve {

// Z85, 40 characters each.
struct KeyPair {
  std::string public_key;
  std::string secret_key;
};

// INVALID_ARGUMENT naming `what` unless `key` is 40 Z85 characters.
absl::Status CheckKey(absl::string_view key, absl::string_view what);
// A key's 32 bytes (what libzmq hands a ZAP handler), or nullopt where
// CheckKey refuses it; and back to Z85.
std::optional<std::string> DecodeKey(absl::string_view key);
std::string EncodeKey(absl::string_view bytes);

// A fresh pair from libzmq (INTERNAL where it was built without CURVE).
absl::StatusOr<KeyPair> NewKeyPair();

// The secret key in `path` (whitespace around it ignored) and the public key
// it implies. INVALID_ARGUMENT naming `flag`: unreadable, not a regular file
// (a symbolic link is not followed), neither this process's user's nor
// root's, open to other users (a secret shared with every local user
// authenticates no one; a root-owned file may be read by its group, as
// mounted Kubernetes secrets are), or not a key. The checks are made on the
// file opened, not on its name.
absl::StatusOr<KeyPair> ReadSecretKeyFile(const std::string& path, absl::string_view flag);

// Public keys, one per line; blank lines and lines starting with '#' are
// skipped. INVALID_ARGUMENT naming `flag` (and the line) for one that is not
// a key, where the file lists none, or where users other than its owner may
// write it (whoever can write the list admits themselves).
absl::StatusOr<std::vector<std::string>> ReadPublicKeysFile(const std::string& path,
                                                            absl::string_view flag);

// `secret_key` into `path`, created readable by its owner only (an existing
// file is not replaced: ALREADY_EXISTS).
absl::Status WriteSecretKeyFile(const std::string& path, absl::string_view secret_key);

}  // namespace kvcache::curve
