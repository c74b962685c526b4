"""What the native-op build needs from this machine: a C++ compiler, ninja, pybind11, Python
headers, and the CPU's SIMD instruction set. Everything here is cheap and compiles nothing, so
``dsplug list`` / ``dsplug report`` can call it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import FrozenSet, List, Optional, Tuple

ISA_ENV = "DSPLUG_OPS_ISA"
ISA_CHOICES = ("native", "avx512", "avx2", "scalar")

# Compiler flags per forced instruction set (x86-64). "native" asks the compiler for this CPU.
_X86_ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": ["-DDSPLUG_SIMD_SCALAR"],
}
# CPU flags (as /proc/cpuinfo names them) each SIMD path needs.
_ISA_CPU_FLAGS = {"avx512": {"avx512f", "avx2", "fma", "f16c"}, "avx2": {"avx2", "fma", "f16c"}, "scalar": set()}


@dataclass(frozen=True)
class Toolchain:
    cxx: Optional[str]
    cxx_version: str
    ninja: Optional[str]
    pybind11_include: Optional[str]
    pybind11_version: str
    python_include: str
    ext_suffix: str

    def missing(self) -> Optional[str]:
        """Why native ops cannot be built here, or None when everything is present."""
        if not self.cxx:
            return "no C++ compiler found (install g++ or clang++, or set CXX)"
        if not self.ninja:
            return "ninja not found (pip install ninja)"
        if not self.pybind11_include:
            return "pybind11 not installed (pip install pybind11)"
        if not os.path.isfile(os.path.join(self.python_include, "Python.h")):
            return f"Python headers not found in {self.python_include} (install the python3-dev package)"
        return None


def _which_cxx() -> Optional[str]:
    wanted = os.environ.get("CXX")
    if wanted:
        parts = shlex.split(wanted)
        return shutil.which(parts[0]) if parts else None
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _which_ninja() -> Optional[str]:
    try:
        import ninja  # the PyPI wheel ships the binary

        candidate = os.path.join(ninja.BIN_DIR, "ninja")
        if os.access(candidate, os.X_OK):
            return candidate
    except ImportError:
        pass
    return shutil.which("ninja")


@functools.lru_cache(maxsize=8)
def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.splitlines()[0].strip() if out else "unknown"


@functools.lru_cache(maxsize=8)
def _toolchain(cxx_env: Optional[str], path_env: Optional[str]) -> Toolchain:
    cxx = _which_cxx()
    try:
        import pybind11

        pb_include, pb_version = pybind11.get_include(), pybind11.__version__
    except ImportError:
        pb_include, pb_version = None, "not installed"
    return Toolchain(
        cxx=cxx,
        cxx_version=_compiler_version(cxx) if cxx else "none",
        ninja=_which_ninja(),
        pybind11_include=pb_include,
        pybind11_version=pb_version,
        python_include=sysconfig.get_paths()["include"],
        ext_suffix=sysconfig.get_config_var("EXT_SUFFIX") or ".so",
    )


def find_toolchain() -> Toolchain:
    """The toolchain for the current environment (memoized per CXX / PATH value)."""
    return _toolchain(os.environ.get("CXX"), os.environ.get("PATH"))


# ------------------------------------------------------------------------------------- CPU / ISA


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> Tuple[FrozenSet[str], str]:
    flags: FrozenSet[str] = frozenset()
    model = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return flags, model
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
        elif key in ("model name", "cpu model") and model in ("", platform.machine()):
            model = value.strip()
    return flags, model


def cpu_flags() -> FrozenSet[str]:
    return _cpuinfo()[0]


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def native_isa() -> str:
    """The best SIMD path of this CPU that the kernels have: avx512, avx2 or scalar."""
    if not is_x86():
        return "scalar"
    flags = cpu_flags()
    for isa in ("avx512", "avx2"):
        if _ISA_CPU_FLAGS[isa] <= flags:
            return isa
    return "scalar"


def requested_isa() -> str:
    """The ISA asked for by DSPLUG_OPS_ISA (default "native")."""
    value = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if value not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV}={value!r} is not valid; choose one of {', '.join(ISA_CHOICES)}")
    return value


def resolve_isa(requested: str) -> Tuple[str, List[str], Optional[str]]:
    """(ISA the build will have, compiler flags, why it cannot run here or None)."""
    if requested == "native":
        if is_x86():
            return native_isa(), ["-march=native"], None
        if sys.platform == "darwin":
            return "scalar", [], None
        return "scalar", ["-mcpu=native"], None
    if not is_x86():
        if requested == "scalar":
            return "scalar", ["-DDSPLUG_SIMD_SCALAR"], None
        return requested, [], f"{ISA_ENV}={requested} needs an x86-64 CPU, this is {platform.machine()}"
    missing = sorted(_ISA_CPU_FLAGS[requested] - cpu_flags())
    why = f"{ISA_ENV}={requested} but this CPU lacks {', '.join(missing)}" if missing else None
    return requested, list(_X86_ISA_FLAGS[requested]), why


def cpu_signature() -> str:
    """Short hash of what -march=native compiles for (the CPU's model and feature flags)."""
    flags, model = _cpuinfo()
    text = platform.machine() + "|" + model + "|" + " ".join(sorted(flags))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------------- libaio


def _flag_dirs(env_names, prefix) -> List[str]:
    dirs = []
    for name in env_names:
        for token in shlex.split(os.environ.get(name, "")):
            if token.startswith(prefix) and len(token) > len(prefix):
                dirs.append(token[len(prefix):])
    return dirs


def _path_dirs(env_names) -> List[str]:
    return [d for name in env_names for d in os.environ.get(name, "").split(os.pathsep) if d]


def find_libaio() -> Tuple[Optional[str], Optional[str]]:
    """(directory holding libaio.h, directory holding libaio.so) or Nones, searching the usual
    places plus CFLAGS/CPATH (-I) and LDFLAGS/LIBRARY_PATH (-L), as DeepSpeed suggests."""
    include_dirs = _flag_dirs(("CFLAGS", "CXXFLAGS", "CPPFLAGS"), "-I") + _path_dirs(("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"))
    include_dirs += ["/usr/local/include", "/usr/include"]
    header = next((d for d in include_dirs if os.path.isfile(os.path.join(d, "libaio.h"))), None)
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    lib_dirs = _flag_dirs(("LDFLAGS",), "-L") + _path_dirs(("LIBRARY_PATH",))
    lib_dirs += ["/usr/local/lib", "/usr/local/lib64", f"/usr/lib/{multiarch}", "/usr/lib64", "/usr/lib", "/lib64", f"/lib/{multiarch}"]
    library = next((d for d in lib_dirs if os.path.exists(os.path.join(d, "libaio.so"))), None)
    return header, library
