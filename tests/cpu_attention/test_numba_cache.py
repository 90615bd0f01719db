"""numba_cache.py: a cached kernel is compiled again when a helper in another file of its package changes.

Each case builds a two-file package in a temporary directory (a cached kernel that inlines a helper from the
other file) and runs it in fresh processes sharing one NUMBA_CACHE_DIR, editing the helper in between.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_INIT = """
import os
from cpu_attention.numba_cache import cache_across_files
if os.environ.get("STAMP_PACKAGE") == "1":
    cache_across_files(os.path.dirname(os.path.abspath(__file__)), tag=lambda: os.environ.get("KERNEL_TAG", ""))
"""
_KERNEL = """
from numba import njit
from kernelpkg.helper import value

@njit(cache=True)
def kernel(x):
    return x + value()
"""
_HELPER = """
from numba import njit

@njit(inline="always")
def value():
    return {}
"""
_RUN = "from kernelpkg.kernel import kernel; print(kernel(1000), sum(kernel.stats.cache_hits.values()))"


def _package(tmp_path: Path, helper_value: int) -> Path:
    package = tmp_path / "kernelpkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text(_INIT)
    (package / "kernel.py").write_text(_KERNEL)
    (package / "helper.py").write_text(_HELPER.format(helper_value))
    return package


def _run(tmp_path: Path, stamp: bool, tag: str = "") -> tuple[int, int]:
    """(kernel(1000), cache hits) from a fresh process: hits 1 means numba loaded the kernel from its cache."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), STAMP_PACKAGE="1" if stamp else "0",
               KERNEL_TAG=tag, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result, hits = done.stdout.split()
    return int(result), int(hits)


@pytest.mark.parametrize("stamp", [True, False], ids=["package_stamped", "numba_alone"])
def test_editing_a_helper_recompiles_the_kernel(tmp_path, stamp):
    """Stamped, the edit is seen; with numba's own stamp the stale kernel comes back from the cache (the reason
    numba_cache.py exists: should numba ever track such helpers itself, the numba_alone case says so)."""
    _package(tmp_path, 1)
    assert _run(tmp_path, stamp)[0] == 1001
    assert _run(tmp_path, stamp) == (1001, 1)  # loaded from the cache
    _package(tmp_path, 2)  # the helper alone changes
    result, hits = _run(tmp_path, stamp)
    if stamp:
        assert (result, hits) == (1002, 0)
    else:
        assert (result, hits) == (1001, 1), "numba now recompiles on a helper's edit: numba_cache.py may be moot"


def test_each_tag_has_its_own_compiled_code(tmp_path):
    """Kernels compiled under one tag (the switches) are never loaded under another."""
    _package(tmp_path, 1)
    assert _run(tmp_path, True, "a") == (1001, 0)
    assert _run(tmp_path, True, "b") == (1001, 0)  # not a's
    assert _run(tmp_path, True, "a") == (1001, 1)
    tagged = {p.parent.name for p in (tmp_path / "cache").rglob("*.nbi")}
    assert tagged == {"a", "b"}
