"""The kvcached binary on loopback for integration tests: free ports (the
server picks them: --listen=127.0.0.1:0), its log collected, SIGTERM at the end."""

import re
import signal
import subprocess
import threading
from typing import List, Sequence

# A small pool of small pages: tests see page counts move, and lavapipe's
# start-up stays quick.
BASE_FLAGS = ("--listen=127.0.0.1:0", "--data_lane_listen=127.0.0.1:0", "--validation",
              "--pool_bytes=67108864", "--page_bytes=8192", "--page_tokens=16",
              "--shutdown_grace=5s")


class Kvcached:
    """A running kvcached; `address` is its gRPC host:port."""

    def __init__(self, binary: str, flags: Sequence[str] = ()) -> None:
        self.log: List[str] = []
        self.address = None
        self._listening = threading.Event()
        self.process = subprocess.Popen([binary, *BASE_FLAGS, *flags], stderr=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        if not self._listening.wait(60) or self.address is None:
            self.process.kill()
            raise RuntimeError("kvcached did not start:\n" + "".join(self.log))

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            found = re.search(r"listening on (\S+)", line)
            if found and self.address is None:
                self.address = found.group(1)
                self._listening.set()
        self._listening.set()  # it exited before listening

    def stop(self) -> int:
        """SIGTERM, then its exit code; raises if the Vulkan validation layer spoke."""
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        self._reader.join(timeout=10)
        text = "".join(self.log)
        if "vulkan validation:" in text:  # device.cc logs each message so
            raise AssertionError("Vulkan validation messages:\n" + text)
        return code
