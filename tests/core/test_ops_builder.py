"""The op builder: status without compiling, cache keys, fallbacks and their single warning,
the DeepSpeed-style builder API, and the `dsplug build-ops` command."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest

import dsplug.op_builder as ob
from dsplug.op_builder import (ALL_OPS, AsyncIOBuilder, CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder,
                               NativeOpsFallbackWarning, OpStatus, OpUnavailableError, all_op_status, op_status)
from dsplug.op_builder import builder as builder_mod
from dsplug.op_builder import toolchain as tc
from tests.conftest import scaled

NATIVE_OK = CPUAdamBuilder().incompatibility() is None and not ob.native_disabled()
needs_native = pytest.mark.skipif(not NATIVE_OK, reason="no native toolchain, or DSPLUG_DISABLE_NATIVE_OPS is set")


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(builder_mod, "_WARNED", set())
    monkeypatch.setattr(builder_mod, "_LOADED", {})


def test_all_ops_names_and_deepspeed_api():
    assert set(ALL_OPS) == {"cpu_adam", "cpu_adagrad", "cpu_lion", "async_io", "quantizer", "sparse_attn"}
    assert ALL_OPS["cpu_adam"] is CPUAdamBuilder and ALL_OPS["async_io"] is AsyncIOBuilder
    assert CPUAdamBuilder().absolute_name() == CPULionBuilder().absolute_name() == "dsplug.ops.cpu_optim_op"
    assert AsyncIOBuilder().absolute_name() == "dsplug.ops.aio.async_io_op"
    assert isinstance(CPULionBuilder().is_compatible(), bool)
    from dsplug.ops.op_builder import CPUAdamBuilder as FromOps

    assert FromOps is CPUAdamBuilder


def test_sources_are_found_through_the_package():
    import dsplug.csrc

    root = builder_mod.csrc_root()
    assert root == __import__("pathlib").Path(next(iter(dsplug.csrc.__path__)))
    for cls in ALL_OPS.values():
        for path in cls().source_paths():
            assert path.is_file(), path
    assert (root / "includes" / "dsplug_simd.h").is_file()


#: run in a child: the ops an installed wheel built at install time are not seen (the tests below are
#: about the cache; in an editable install there are none, in CI's tox install there are)
WITHOUT_PREBUILT = ("import pathlib, dsplug.op_builder.builder as b; "
                    "b.prebuilt_root = lambda: pathlib.Path('/nonexistent/dsplug-prebuilt'); ")


def test_status_compiles_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPLUG_OPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(builder_mod, "prebuilt_root", lambda: tmp_path / "no-prebuilt")
    monkeypatch.delenv("DSPLUG_DISABLE_NATIVE_OPS", raising=False)
    statuses = all_op_status()
    assert [s.name for s in statuses] == sorted(ALL_OPS)
    for s in statuses:
        assert isinstance(s, OpStatus) and s.built is False and isinstance(s.detail, str) and s.detail
        if s.compatible:
            assert "not built yet" in s.detail
    assert not (tmp_path / "cache").exists()  # nothing was written, let alone compiled
    if CPUAdamBuilder().incompatibility() is None:
        assert op_status("cpu_adam").detail.startswith(f"{tc.native_isa()} SIMD")
        monkeypatch.setenv("DSPLUG_DISABLE_NATIVE_OPS", "1")
        assert "disabled by DSPLUG_DISABLE_NATIVE_OPS=1" in op_status("cpu_lion").detail
        assert "libaio" in op_status("async_io").detail or "thread pool" in op_status("async_io").detail


def test_unknown_op_is_a_key_error_with_suggestion():
    with pytest.raises(KeyError, match="unknown native op 'cpu_adamw'.*did you mean 'cpu_adam'"):
        op_status("cpu_adamw")


def test_cache_key_follows_sources_flags_and_isa(tmp_path, monkeypatch):
    b = CPUAdamBuilder()
    key = b.cache_key()
    assert key == CPUAdamBuilder().cache_key()  # deterministic
    assert CPUAdamBuilder(isa="scalar").cache_key() != key
    assert CPUAdagradBuilder().cache_key() == key  # the optimizers share one build
    assert AsyncIOBuilder().cache_key() != key
    copy = tmp_path / "csrc"
    shutil.copytree(builder_mod.csrc_root(), copy)
    monkeypatch.setattr(builder_mod, "csrc_root", lambda: copy)
    assert CPUAdamBuilder().cache_key() == key  # same content elsewhere (editable vs installed): same build
    header = copy / "includes" / "dsplug_simd.h"
    header.write_text(header.read_text() + "\n// edited\n")
    assert CPUAdamBuilder().cache_key() != key  # a shared header changed: rebuild
    monkeypatch.setenv("DSPLUG_OPS_CACHE", str(tmp_path / "c"))
    assert str(CPUAdamBuilder().build_dir()).startswith(str(tmp_path / "c"))


def test_cache_root_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DSPLUG_OPS_CACHE", raising=False)
    assert ob.cache_root() == __import__("pathlib").Path.home() / ".cache" / "dsplug" / "ops"
    monkeypatch.setenv("DSPLUG_OPS_CACHE", str(tmp_path))
    assert ob.cache_root() == tmp_path


def test_isa_env_is_validated(monkeypatch):
    monkeypatch.setenv("DSPLUG_OPS_ISA", "sse9")
    why = CPUAdamBuilder().incompatibility()
    assert why and "DSPLUG_OPS_ISA='sse9' is not valid" in why and "avx2" in why
    with pytest.raises(ValueError, match="isa='neon' is not valid"):
        CPUAdamBuilder(isa="neon")


@pytest.mark.skipif(not tc.is_x86() or "avx512f" in tc.cpu_flags(), reason="needs an x86 CPU without AVX-512")
def test_isa_the_cpu_lacks_is_incompatible():
    status_why = CPUAdamBuilder(isa="avx512").incompatibility()
    assert "DSPLUG_OPS_ISA=avx512 but this CPU lacks avx512f" in status_why


def test_missing_compiler_falls_back_with_one_warning(monkeypatch, fresh_warnings, tmp_path):
    """No compiler: every op is the pure-torch / pure-Python fallback, one warning in total."""
    monkeypatch.delenv("DSPLUG_DISABLE_NATIVE_OPS", raising=False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert "no C++ compiler found" in op_status("cpu_adam").detail and not op_status("cpu_adam").compatible
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adam = CPUAdamBuilder().load()
        lion = CPULionBuilder().load()
        aio = AsyncIOBuilder().load()
    ours = [w for w in caught if issubclass(w.category, NativeOpsFallbackWarning)]
    assert len(ours) == 1
    assert "cpu_adam" in str(ours[0].message) and "no C++ compiler found" in str(ours[0].message)
    assert not adam.is_native and not lion.is_native and not aio.is_native
    with pytest.raises(OpUnavailableError, match="cannot be built here: no C\\+\\+ compiler found"):
        CPUAdamBuilder().load(fallback=False)
    import torch

    h = aio.aio_handle()
    t = torch.arange(10.0)
    h.sync_pwrite(t, tmp_path / "x.bin")
    back = torch.empty_like(t)
    h.sync_pread(back, tmp_path / "x.bin")
    assert h.backend == "python" and torch.equal(back, t)


def test_missing_ninja_or_pybind11_is_reported(monkeypatch):
    t = tc.find_toolchain()
    import dataclasses

    assert "ninja not found (pip install ninja)" == dataclasses.replace(t, cxx="c++", ninja=None).missing()
    assert "pybind11 not installed" in dataclasses.replace(t, cxx="c++", ninja="ninja", pybind11_include=None).missing()


def test_compile_error_falls_back_and_strict_load_raises(monkeypatch, fresh_warnings, tmp_path):
    """A source that does not compile: load() warns and falls back; build() shows the compiler."""
    if not NATIVE_OK:
        pytest.skip("no native toolchain")
    copy = tmp_path / "csrc"
    shutil.copytree(builder_mod.csrc_root(), copy)
    for rel, _ in CPULionBuilder.SOURCES:  # all of them, so no good file compiles meanwhile
        (copy / rel).write_text("this is not C++;\n")
    monkeypatch.setattr(builder_mod, "csrc_root", lambda: copy)
    monkeypatch.setenv("DSPLUG_OPS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ob.OpBuildError, match="(?s)building native op 'cpu_lion' \\(build 'cpu_optim'\\) failed.*this is not C"):
        CPULionBuilder().build()
    with pytest.warns(NativeOpsFallbackWarning, match="cpu_lion.*building or loading it failed"):
        op = CPULionBuilder().load()
    assert not op.is_native


@needs_native
def test_build_ops_cli_reports_cached_builds():
    """`dsplug build-ops` (ops already built by the other test modules' fixtures or now)."""
    proc = subprocess.run([sys.executable, "-m", "dsplug.cli", "build-ops", "cpu_adam", "async_io"],
                          capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2/2 op(s) ready" in proc.stdout and "cpu_adam" in proc.stdout
    assert op_status("cpu_adam").built and op_status("async_io").built
    bad = subprocess.run([sys.executable, "-m", "dsplug.cli", "build-ops", "cpu_adm"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown op(s) 'cpu_adm'" in bad.stderr


@pytest.mark.slow
@needs_native
def test_cold_build_of_all_ops_into_a_fresh_cache(tmp_path):
    env = dict(os.environ, DSPLUG_OPS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", WITHOUT_PREBUILT + "from dsplug.cli import main; "
                           "raise SystemExit(main(['build-ops', '--json']))"], capture_output=True,
                          text=True, env=env, timeout=scaled(900))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    result = json.loads(proc.stdout)
    assert {r["op"] for r in result["ops"]} == set(ALL_OPS) and all(r["compiled"] for r in result["ops"])
    status = subprocess.run([sys.executable, "-c", WITHOUT_PREBUILT + "from dsplug.op_builder import all_op_status "
                             "as a; print(all(s.built for s in a()))"], capture_output=True, text=True, env=env)
    assert status.stdout.strip() == "True"


# ------------------------------------------------------------------- install-time builds, first-use notice
FAKE_CXX = """#!/bin/sh
# a stand-in compiler: writes the files ninja expects, compiles nothing
if [ "$1" = "--version" ]; then echo "fake-cxx 1.0"; exit 0; fi
out=""; dep=""
while [ $# -gt 0 ]; do
  case "$1" in -o) out="$2"; shift;; -MF) dep="$2"; shift;; esac
  shift
done
[ -n "$dep" ] && echo "$out:" > "$dep"
echo fake > "$out"
"""
REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    if os.name != "posix" or tc.find_toolchain().ninja is None or tc.find_toolchain().pybind11_include is None:
        pytest.skip("needs POSIX, ninja and pybind11")
    path = tmp_path / "fake-cxx"
    path.write_text(FAKE_CXX)
    path.chmod(0o755)
    monkeypatch.setenv("CXX", str(path))
    monkeypatch.setenv("DSPLUG_OPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DSPLUG_DISABLE_NATIVE_OPS", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return path


def test_cache_key_ignores_where_pybind11_and_python_headers_are(monkeypatch):
    """An install-time build runs in pip's isolated environment, with pybind11 elsewhere: same key."""
    import dataclasses

    key = CPUAdamBuilder().cache_key()
    elsewhere = dataclasses.replace(tc.find_toolchain(), pybind11_include="/tmp/pip-build-env-x/pybind11/include",
                                    python_include="/opt/python/include/python3.11")
    monkeypatch.setattr(tc, "find_toolchain", lambda: elsewhere)
    assert CPUAdamBuilder().cache_key() == key
    monkeypatch.setattr(tc, "find_toolchain", lambda: dataclasses.replace(elsewhere, pybind11_version="0.0.1"))
    assert CPUAdamBuilder().cache_key() != key  # another pybind11 is another build


def test_a_first_use_build_says_so_before_and_after(fake_cxx, tmp_path, capsys, monkeypatch):
    library = CPUAdamBuilder().build(announce=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"dsplug: building native op cpu_adam, first use, ~{CPUAdamBuilder.BUILD_SECONDS} s "
                      "(`dsplug build-ops` builds every op ahead of time)")
    assert err[1].startswith("dsplug: built native op cpu_adam in ") and str(library.parent) in err[1]
    assert len(err) == 2 and library.is_file()
    CPUAdamBuilder().build(announce=True)  # built: nothing to say
    CPUAdamBuilder().build(force=True)  # `dsplug build-ops` reports its builds itself
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "1")  # one process per machine announces; the others wait on the lock
    QuantizerBuilder = ob.QuantizerBuilder
    QuantizerBuilder().build(announce=True)
    assert capsys.readouterr().err == ""


def test_loading_an_unbuilt_op_announces_its_build(monkeypatch):
    calls = []

    def build(self, **kwargs):
        calls.append(kwargs)
        raise ob.OpBuildError("stop here")

    monkeypatch.setattr(builder_mod.OpBuilder, "build", build)
    monkeypatch.setattr(builder_mod, "_EXTENSIONS", {})
    with pytest.raises(ob.OpBuildError):
        CPUAdamBuilder().load_extension()
    assert calls and calls[0].get("announce") is True


def test_setup_builds_every_op_into_the_package_and_the_runtime_finds_it(fake_cxx, tmp_path, monkeypatch):
    """setup.py's install-time step (with a stand-in compiler): every op lands in the package's
    prebuilt folder with only its library and build.json, and the runtime loads from there first."""
    package = tmp_path / "site" / "dsplug"
    shutil.copytree(REPO / "core", package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "csrc", package / "csrc", ignore=shutil.ignore_patterns("__pycache__", "prebuilt"))
    script = ("import runpy, sys\nsys.argv = ['setup.py', '--name']\n"
              f"runpy.run_path({str(REPO / 'setup.py')!r})['build_native_ops']({str(package)!r})\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("dsplug install: ")]
    assert lines[0].startswith("dsplug install: building native ops async_io, cpu_optim, quantizer, sparse_attn")
    assert any(line.startswith("dsplug install: built native op(s) cpu_adagrad, cpu_adam, cpu_lion (") for line in lines)
    assert lines[-1].startswith("dsplug install: native ops done in ")
    prebuilt = package / "csrc" / "prebuilt"
    monkeypatch.setattr(builder_mod, "csrc_root", lambda: package / "csrc")
    for name in ALL_OPS:
        builder = ob.get_builder(name)
        assert builder.is_prebuilt() and builder.build_dir().parent == prebuilt, name
        assert sorted(p.name for p in builder.build_dir().iterdir()) == sorted(["build.json", builder.library_name()])
        assert op_status(name).built and "built at install in" in op_status(name).detail
        assert builder.build() == builder.build_dir() / builder.library_name()
    assert sorted(p.name for p in prebuilt.iterdir()) == sorted({ob.get_builder(n).dir_name() for n in ALL_OPS})
    assert not (tmp_path / "cache").exists()  # nothing built at first use
    skipped = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300,
                             env=dict(os.environ, DSPLUG_BUILD_OPS="0"))
    assert "native ops not built (DSPLUG_BUILD_OPS=0)" in skipped.stdout
