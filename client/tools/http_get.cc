#include "tools/http_get.h"

#include <sys/socket.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "wire/lane/socket.h"

namespace kvcache {

absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path,
                                    absl::Duration timeout) {
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", address, "\r\nConnection: close\r\n\r\n");
  // The lane's connect sends its "preamble" first: here, the whole request.
  absl::StatusOr<int> connected = lane::Connect(address, timeout, request);
  if (!connected.ok()) {
    return absl::UnavailableError(
        absl::StrCat("GET http://", address, path, ": ", connected.status().message()));
  }
  lane::OwnedFd fd(*connected);
  std::string answer;
  char buffer[64 << 10];
  while (true) {
    const ssize_t got = recv(fd.get(), buffer, sizeof(buffer), 0);
    if (got == 0) break;
    if (got < 0) {
      if (errno == EINTR) continue;
      return lane::SocketError(absl::StrCat("GET http://", address, path).c_str());
    }
    answer.append(buffer, static_cast<size_t>(got));
  }
  const size_t body = answer.find("\r\n\r\n");
  const std::string status_line = answer.substr(0, answer.find("\r\n"));
  if (body == std::string::npos || !absl::StrContains(status_line, " 200")) {
    return absl::UnavailableError(
        absl::StrCat("GET http://", address, path, ": answered \"", status_line, "\""));
  }
  return answer.substr(body + 4);
}

}  // namespace kvcache
