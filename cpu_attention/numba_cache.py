"""numba's on-disk cache for kernels whose source spans several files of one package.

numba stamps a cached function with the contents of its own file alone, so after an edit to a helper that a kernel
inlines from another file (block_attention.py, the tiles, llvm_ops.py) it would load stale machine code.
cache_across_files(package) stamps every cached function of the package with all of its .py files, and files the
compiled code in a subdirectory named by `tag()` (kernel_switches.cache_tag), so processes with other switches
never load each other's kernels. numba has no public hook for this: the locator below sits first in the cache
implementation's list of locator classes (`_CacheImpl._locator_classes` in numba 0.60, `CacheImpl._locator_classes`
in 0.68), claims only the package's files, and leaves where the cache lives to the locator numba would have chosen.
"""
import functools
import hashlib
import os
from pathlib import Path
from typing import Callable

from numba.core import caching

_LOCATORS = (getattr(caching, "CacheImpl", None) or caching._CacheImpl)._locator_classes  # numba's, in order
_PACKAGES: dict[str, Callable[[], str]] = {}  # package directory -> its tag function


def cache_across_files(package_dir: str, tag: Callable[[], str] = lambda: "") -> None:
    """Stamp every cached numba function defined in package_dir with all the package's sources (idempotent)."""
    _PACKAGES[os.path.realpath(package_dir)] = tag
    if _PackageLocator not in _LOCATORS:
        _LOCATORS.insert(0, _PackageLocator)


def package_stamp(package_dir: str) -> str:
    """A digest of every .py file in package_dir: names and contents."""
    stats = [(str(f), f.stat()) for f in sorted(Path(package_dir).glob("*.py"))]
    return _digest(tuple((path, stat.st_mtime_ns, stat.st_size) for path, stat in stats))


@functools.lru_cache(maxsize=None)
def _digest(files: tuple) -> str:
    """Hashed once per set of (path, mtime, size): the stamp is asked for at every cache load and save."""
    digest = hashlib.sha256()
    for path, _, _ in files:
        digest.update(os.path.basename(path).encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return digest.hexdigest()


class _PackageLocator(caching._CacheLocator):
    """numba's own locator for the function's file, with the package's stamp and the tag's subdirectory."""

    def __init__(self, inner, package_dir: str, tag: str):
        self._inner, self._package_dir, self._tag = inner, package_dir, tag

    def get_cache_path(self):
        return os.path.join(self._inner.get_cache_path(), self._tag) if self._tag else self._inner.get_cache_path()

    def get_source_stamp(self):
        return package_stamp(self._package_dir)

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        package_dir = os.path.dirname(os.path.realpath(py_file))
        if package_dir not in _PACKAGES:
            return None
        for inner_class in _LOCATORS:
            inner = None if inner_class is cls else inner_class.from_function(py_func, py_file)
            if inner is not None:
                break
        else:
            return None
        self = cls(inner, package_dir, _PACKAGES[package_dir]())
        try:
            self.ensure_cache_path()
        except OSError:  # as numba's locators do: no writable cache directory, no caching
            return None
        return self
