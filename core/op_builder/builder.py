"""Compile, cache and load one native op; fall back to its pure-torch implementation.

A build is a ninja project in ``<cache>/<build>-<key>/`` where ``key`` hashes everything that
changes the binary: the op's sources and shared headers, compiler flags, the compiler's version,
the CPU instruction set (and, for ``-march=native``, the CPU itself), Python's ABI and pybind11's
version. Only pybind11 and Python headers are used (no libtorch), so a cold build takes seconds.
Builds happen in a temporary directory renamed into place under a file lock, so concurrent
processes never load a half-written library.

``pip install .`` builds every op into the installed package (``dsplug/csrc/prebuilt/<build>-<key>/``,
see setup.py); the runtime finds a build there first, then in the cache. The key leaves out where
pybind11's and Python's headers are (an isolated build environment has its own paths), so a build
made at install time has the key the runtime computes. An op built at first use (no prebuilt one,
say in an editable install or on another CPU) says so before and after: it takes seconds to
minutes.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import toolchain as tc

BUILDER_VERSION = "1"
CACHE_ENV = "DSPLUG_OPS_CACHE"
DISABLE_ENV = "DSPLUG_DISABLE_NATIVE_OPS"
LIBRARY_META = "build.json"


class OpBuildError(RuntimeError):
    """Compiling a native op failed; the message holds the compiler's output."""


class OpUnavailableError(RuntimeError):
    """The native op cannot be built on this machine (and no fallback was allowed)."""


class NativeOpsFallbackWarning(UserWarning):
    """A native op is not available and its pure-torch fallback is used instead."""


def cache_root() -> Path:
    """Where builds live: $DSPLUG_OPS_CACHE, else ~/.cache/dsplug/ops."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dsplug" / "ops").expanduser()


def native_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


class LazyNativeOp:
    """An op's native extension, loaded from ``builder_class`` on first use (building it if
    needed): ``native()`` is the extension module, or None when the pure-torch fallback runs
    (``DSPLUG_DISABLE_NATIVE_OPS`` set, or no build possible; the builder warns once)."""

    def __init__(self, builder_class):
        self.builder_class = builder_class
        self.op = None  # what builder_class().load() gave (native or fallback), once resolved

    def native(self):
        if native_disabled():
            self.builder_class().load()  # the fallback, with its one warning
            return None
        if self.op is None:
            self.op = self.builder_class().load()
        return self.op.native


def csrc_root() -> Path:
    """The C++ sources, shipped as the package data of ``dsplug.csrc`` (editable or installed)."""
    import dsplug.csrc

    return Path(next(iter(dsplug.csrc.__path__)))


#: folder (under the installed ``dsplug.csrc``) of the ops built by ``pip install``
PREBUILT = "prebuilt"


def prebuilt_root() -> Path:
    """Where ``pip install`` put the ops it built (absent in a source tree or editable install)."""
    return csrc_root() / PREBUILT


def _first_use_announcer() -> bool:
    """Whether this process announces a first-use build: one process per machine (local rank 0) says
    it; the others wait on the build lock while it builds."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


_WARNED: set = set()
_LOADED: Dict[Tuple[str, str], object] = {}  # (op, key) -> op module
_EXTENSIONS: Dict[Tuple[str, str], object] = {}  # (build, key) -> extension module
_LOAD_LOCK = threading.RLock()


def warn_fallback(op: str, reason: str) -> None:
    """One warning per distinct reason per process, however many ops fall back for it."""
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"dsplug native op '{op}' is not available: {reason}. Using the pure-torch fallback, which "
        f"computes the same results more slowly (other ops falling back for the same reason are not "
        f"reported again). Run `dsplug report` for the status of every op.",
        NativeOpsFallbackWarning,
        stacklevel=4,
    )


def _ninja_escape(path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _shell_join(args: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(str(a)) for a in args)


@contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: builds are still atomic through the rename
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class OpBuilder:
    """Base of the builders. Subclasses name their sources and wrap the loaded extension.

    DeepSpeed-style API: ``Builder().load()`` returns the op (native, or the pure-torch fallback
    with one warning), ``is_compatible()`` says whether it can be built here, ``absolute_name()``
    is the extension's import name.
    """

    NAME = ""  # op name as in ALL_OPS and `dsplug build-ops`
    BUILD_SECONDS = 20  # typical cold build on 2 idle cores (the first-use message quotes it)
    BUILD_NAME = ""  # build (cache entry, extension) this op lives in; default NAME. Ops may share one.
    EXT_NAME = ""  # extension module name (PyInit_<EXT_NAME>_<key>)
    PACKAGE = "dsplug.ops"
    SOURCES: Tuple[Tuple[str, str], ...] = ()  # (path under csrc/, optimization level)
    USES_SIMD = True  # compiled per instruction set (cpu optimizers) or not (aio)

    def __init__(self, isa: Optional[str] = None):
        if isa is not None and isa not in tc.ISA_CHOICES:
            raise ValueError(f"isa={isa!r} is not valid; choose one of {', '.join(tc.ISA_CHOICES)}")
        self._isa_request = isa

    # ------------------------------------------------------------------ identity
    def absolute_name(self) -> str:
        return f"{self.PACKAGE}.{self.EXT_NAME}"

    def build_name(self) -> str:
        return self.BUILD_NAME or self.NAME

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------ what is built
    def isa_request(self) -> str:
        return self._isa_request or tc.requested_isa()

    def isa(self) -> str:
        """Instruction set the build targets ("avx512", "avx2", "scalar"), or "n/a"."""
        return tc.resolve_isa(self.isa_request())[0] if self.USES_SIMD else "n/a"

    def source_paths(self) -> List[Path]:
        root = csrc_root()
        return [root / rel for rel, _ in self.SOURCES]

    def include_dirs(self) -> List[Path]:
        root = csrc_root()
        dirs = [root / "includes"]
        for path in self.source_paths():
            if path.parent not in dirs:
                dirs.append(path.parent)
        return dirs

    def hashed_files(self) -> List[Path]:
        files = set(self.source_paths())
        for directory in self.include_dirs():
            files.update(p for p in directory.glob("*") if p.suffix in (".h", ".hpp", ".cpp"))
        return sorted(files)

    def extra_cxx_flags(self) -> List[str]:
        return []

    def extra_ldflags(self) -> List[str]:
        return []

    def cxx_flags(self) -> List[str]:
        t = tc.find_toolchain()
        flags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-pthread", "-ffp-contract=off", "-Wall",
                 "-Wno-maybe-uninitialized"]  # GCC 12 warns inside its own AVX-512 headers
        if self.USES_SIMD:
            flags += tc.resolve_isa(self.isa_request())[1]
            if tc.is_x86():
                flags.append("-fno-tree-vectorize")  # SIMD is explicit; keeps builds fast
        flags += [f"-I{d}" for d in self.include_dirs()]
        flags += [f"-I{t.pybind11_include}", f"-I{t.python_include}"]
        return flags + self.extra_cxx_flags()

    def ldflags(self) -> List[str]:
        flags = ["-shared", "-pthread"]
        if sys.platform == "darwin":
            flags += ["-undefined", "dynamic_lookup"]
        return flags + self.extra_ldflags()

    def op_incompatibility(self) -> Optional[str]:
        """Op-specific reason it cannot be built here (subclasses)."""
        return None

    def incompatibility(self) -> Optional[str]:
        """Why this op cannot be built and run here, or None. Compiles nothing."""
        if os.name != "posix":
            return f"native ops need a POSIX system, this is {os.name}"
        missing = tc.find_toolchain().missing()
        if missing:
            return missing
        if self.USES_SIMD:
            try:
                why = tc.resolve_isa(self.isa_request())[2]
            except ValueError as err:
                return str(err)
            if why:
                return why
        return self.op_incompatibility()

    def is_compatible(self, verbose: bool = False) -> bool:
        why = self.incompatibility()
        if why and verbose:
            print(f"[dsplug] {self.NAME}: {why}", file=sys.stderr)
        return why is None

    def backend_detail(self) -> str:
        """Short description of what the native build does (status lines)."""
        return f"{self.isa()} SIMD" if self.USES_SIMD else "native"

    # ------------------------------------------------------------------ cache
    def cache_key(self) -> str:
        t = tc.find_toolchain()
        digest = hashlib.sha256()
        root = csrc_root()
        # where the sources and headers live does not matter (an install-time build runs in an isolated
        # environment with its own pybind11 path), only their content and versions (hashed below)
        flags = " ".join(self.cxx_flags() + ["|"] + self.ldflags()).replace(str(root), "<csrc>")
        for place, name in ((t.pybind11_include, "<pybind11>"), (t.python_include, "<python>")):
            flags = flags.replace(f"-I{place}", f"-I{name}") if place else flags
        parts = [BUILDER_VERSION, self.build_name(), self.EXT_NAME, t.cxx or "", t.cxx_version, t.pybind11_version,
                 t.ext_suffix, sys.version, flags]
        if self.USES_SIMD:
            parts += [self.isa(), tc.cpu_signature() if self.isa_request() == "native" else platform.machine()]
        for part in parts:
            digest.update(part.encode() + b"\0")
        for path in self.hashed_files():
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
        return digest.hexdigest()[:16]

    def dir_name(self) -> str:
        return f"{self.build_name()}-{self.cache_key()}"

    def cache_dir(self) -> Path:
        """Where a build at first use (or by ``dsplug build-ops``) goes."""
        return cache_root() / self.dir_name()

    def prebuilt_dir(self) -> Path:
        """Where ``pip install`` put this build, if it did."""
        return prebuilt_root() / self.dir_name()

    def is_prebuilt(self) -> bool:
        try:
            return (self.prebuilt_dir() / self.library_name()).is_file()
        except (OSError, ValueError):
            return False

    def build_dir(self) -> Path:
        """The build the runtime loads: the one made at install time, else the cache's."""
        return self.prebuilt_dir() if self.is_prebuilt() else self.cache_dir()

    def module_name(self) -> str:
        """Init name of this build's module. It carries the cache key: CPython keeps one module
        per extension name, so two builds (say avx2 and scalar) need two names to coexist."""
        return f"{self.EXT_NAME}_{self.cache_key()}"

    def library_name(self) -> str:
        return f"{self.module_name()}{tc.find_toolchain().ext_suffix}"

    def library_path(self) -> Path:
        return self.build_dir() / self.library_name()

    def is_built(self) -> bool:
        """A build for the current sources, flags and CPU is in the cache."""
        try:
            return self.library_path().is_file()
        except (OSError, ValueError):
            return False

    def build_info(self) -> Optional[dict]:
        try:
            return json.loads((self.build_dir() / LIBRARY_META).read_text())
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ build
    def _ninja_file(self, objects_dir: str, library_name: str) -> str:
        t = tc.find_toolchain()
        base = self.cxx_flags()
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {_shell_join([t.cxx])}",
            f"cflags = {_shell_join(base + [f'-DDSPLUG_EXT_NAME={self.module_name()}'])}",
            f"ldflags = {_shell_join(self.ldflags())}",
            "rule compile",
            "  command = $cxx -MMD -MF $out.d $cflags $opt -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = compile $in",
            "rule link",
            "  command = $cxx $in $ldflags -o $out",
            "  description = link $out",
        ]
        objects = []
        for (rel, opt), path in zip(self.SOURCES, self.source_paths()):
            obj = f"{objects_dir}/{Path(rel).stem}.o"
            objects.append(obj)
            lines += [f"build {_ninja_escape(obj)}: compile {_ninja_escape(path)}", f"  opt = {opt}"]
        lines.append(f"build {_ninja_escape(library_name)}: link {' '.join(_ninja_escape(o) for o in objects)}")
        lines.append(f"default {_ninja_escape(library_name)}")
        return "\n".join(lines) + "\n"

    def build(self, force: bool = False, verbose: bool = False, root: Optional[Path] = None,
              announce: bool = False) -> Path:
        """Compile (unless built already) and return the extension's path. Raises
        OpUnavailableError or OpBuildError.

        ``root``: build into this folder (setup.py: the package's prebuilt folder) instead of the
        cache. ``announce``: a first-use build, which prints one line before it starts and one when
        done (stderr)."""
        why = self.incompatibility()
        if why:
            raise OpUnavailableError(f"native op '{self.NAME}' cannot be built here: {why}")
        if root is None and not force and self.is_prebuilt():
            return self.prebuilt_dir() / self.library_name()
        root = Path(root) if root is not None else cache_root()
        final = root / self.dir_name()
        library = final / self.library_name()
        if library.is_file() and not force:
            return library
        root.mkdir(parents=True, exist_ok=True)
        announce = announce and _first_use_announcer()
        if announce:
            print(f"dsplug: building native op {self.NAME}, first use, ~{self.BUILD_SECONDS} s "
                  f"(`dsplug build-ops` builds every op ahead of time)", file=sys.stderr, flush=True)
        with _file_lock(root / f"{final.name}.lock"):
            if library.is_file() and not force:
                if announce:
                    print(f"dsplug: native op {self.NAME} ready (another process built it)", file=sys.stderr,
                          flush=True)
                return library  # another process built it while we waited
            work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
            (work / "build.ninja").write_text(self._ninja_file("obj", library.name))
            started = time.perf_counter()
            t = tc.find_toolchain()
            proc = subprocess.run([t.ninja, "-C", str(work)], capture_output=True, text=True)
            seconds = time.perf_counter() - started
            if verbose and proc.stdout:
                print(proc.stdout, file=sys.stderr)
            if proc.returncode != 0:
                log = (proc.stdout + proc.stderr)[-6000:]
                raise OpBuildError(f"building native op '{self.NAME}' (build '{self.build_name()}') failed "
                                   f"(ninja exit {proc.returncode}); "
                                   f"build files kept in {work}\n{log}")
            meta = {"build": self.build_name(), "key": self.cache_key(), "isa": self.isa(),
                    "detail": self.backend_detail(), "compiler": t.cxx_version, "cxx_flags": self.cxx_flags(),
                    "ldflags": self.ldflags(), "build_seconds": round(seconds, 3),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            (work / LIBRARY_META).write_text(json.dumps(meta, indent=2))
            if final.exists():  # forced rebuild: move the old one aside (it may be loaded)
                shutil.rmtree(final, ignore_errors=True)
            os.rename(work, final)
        if announce:
            print(f"dsplug: built native op {self.NAME} in {seconds:.1f} s (cached in {final})", file=sys.stderr,
                  flush=True)
        return library

    def load_extension(self, verbose: bool = False):
        """Build if needed and import the native extension module (no fallback)."""
        key = (self.build_name(), self.cache_key())
        with _LOAD_LOCK:
            if key not in _EXTENSIONS:
                path = self.build(verbose=verbose, announce=True)
                spec = importlib.util.spec_from_file_location(f"{self.PACKAGE}.{self.module_name()}", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                _EXTENSIONS[key] = module
            return _EXTENSIONS[key]

    # ------------------------------------------------------------------ load
    def make_module(self, native):
        """The op as callers use it, over the extension module or None for the fallback."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_module")  # abstract

    def load(self, verbose: bool = False, fallback: bool = True):
        """The op: native when it can be built here, else (fallback=True) the pure-torch
        implementation with one warning. With fallback=False failures raise."""
        with _LOAD_LOCK:
            if native_disabled():
                if not fallback:
                    raise OpUnavailableError(f"native op '{self.NAME}' is disabled by {DISABLE_ENV}=1")
                return self._fallback(f"disabled by {DISABLE_ENV}=1")
            why = self.incompatibility()
            if why:
                if not fallback:
                    raise OpUnavailableError(f"native op '{self.NAME}' cannot be built here: {why}")
                return self._fallback(why)
            key = (self.NAME, self.cache_key())
            if key not in _LOADED:
                try:
                    _LOADED[key] = self.make_module(self.load_extension(verbose))
                except (OpBuildError, OSError, ImportError) as err:
                    if not fallback:
                        raise
                    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                    return self._fallback(f"building or loading it failed ({first}); run `dsplug build-ops "
                                          f"{self.NAME}` to see the compiler output")
            return _LOADED[key]

    def _fallback(self, reason: str):
        warn_fallback(self.NAME, reason)
        key = (self.NAME, "fallback")
        if key not in _LOADED:
            _LOADED[key] = self.make_module(None)
        return _LOADED[key]
