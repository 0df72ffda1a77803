"""Builds the kvcached package: pyproject.toml holds the metadata; this adds
the build step that generates the protobuf and gRPC stubs from protos/ into
the built package (kvcached/_stubs), so they are never committed.

The protos are found at $KVCACHED_PROTO_DIR, else ../../protos (this
repository's), which pip reaches because it builds in place.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_stubs  # noqa: E402 (beside this file; standard library only)


class BuildWithStubs(build_py):
    """build_py, then the stubs generated into the build's kvcached/_stubs."""

    def run(self) -> None:
        super().run()
        if self.dry_run:
            return
        generate_stubs.generate(os.path.join(self.build_lib, "kvcached", "_stubs"))


setup(cmdclass={"build_py": BuildWithStubs})
