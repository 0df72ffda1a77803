"""pytest set-up for the Python client's tests: the package from the source
tree, its stubs generated into a build directory first.

    /usr/bin/python3 -m pytest tests/client/python \\
        [--kvcached-stubs-dir build-python/stubs] [--kvcached build/server/kvcached]

The stubs directory is --kvcached-stubs-dir, else $KVCACHED_STUBS_DIR, else
build-python/stubs under the repository root (ignored by git). Tests that
need a server use --kvcached (else $KVCACHED_BINARY, else build/server/kvcached
of this checkout); they are skipped when no binary is there.
"""

import importlib.util
import os
import sys

REPO_ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PACKAGE_ROOT = os.path.join(REPO_ROOT, "client", "python")


def pytest_addoption(parser):
    parser.addoption("--kvcached-stubs-dir", default=None,
                     help="where the generated stubs go (default: build-python/stubs)")
    parser.addoption("--kvcached", default=None,
                     help="the kvcached binary the integration tests start")


def _load_generator():
    """client/python/generate_stubs.py, loaded by path (it is no package module)."""
    path = os.path.join(PACKAGE_ROOT, "generate_stubs.py")
    spec = importlib.util.spec_from_file_location("kvcached_generate_stubs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kvcached_binary(config):
    """The server binary the integration tests start, or None where there is none."""
    given = config.getoption("--kvcached") or os.environ.get("KVCACHED_BINARY")
    if given:
        if not os.access(given, os.X_OK):
            raise FileNotFoundError("--kvcached %s is no executable" % given)
        return given
    default = os.path.join(REPO_ROOT, "build", "server", "kvcached")
    return default if os.access(default, os.X_OK) else None


def pytest_configure(config):
    stubs_dir = (config.getoption("--kvcached-stubs-dir")
                 or os.environ.get("KVCACHED_STUBS_DIR")
                 or os.path.join(REPO_ROOT, "build-python", "stubs"))
    stubs_dir = os.path.abspath(stubs_dir)
    _load_generator().generate(stubs_dir, os.path.join(REPO_ROOT, "protos"))
    os.environ["KVCACHED_STUBS_DIR"] = stubs_dir
    sys.path.insert(0, PACKAGE_ROOT)


import pytest  # noqa: E402 (after the path set-up above, which the fixtures do not need)


@pytest.fixture(scope="session")
def kvcached_path(pytestconfig):
    """The kvcached binary; the test is skipped where none was built or given."""
    path = kvcached_binary(pytestconfig)
    if path is None:
        pytest.skip("no kvcached binary (build it, or pass --kvcached)")
    return path
