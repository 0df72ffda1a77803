"""The generated protobuf and gRPC stubs (kvcache/v1, grpc/health/v1).

An installed package has them here, written by setup.py's build step. Used
straight from the source tree they live in a build directory instead
(generate_stubs.py OUT_DIR), named by $KVCACHED_STUBS_DIR, which this
package's path is extended with. They are never committed.
"""

import os

_STUBS_DIR = os.environ.get("KVCACHED_STUBS_DIR")
if _STUBS_DIR:
    __path__.append(os.path.abspath(_STUBS_DIR))  # noqa: F821 (a package's own __path__)
