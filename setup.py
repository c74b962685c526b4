"""Maps the design card's top-level folders onto the ``dsplug`` import package, and builds the
native ops into the package when it is installed.

core/    -> dsplug
plugins/ -> dsplug.plugins
csrc/    -> dsplug.csrc   (C++ sources shipped as package data for the op builder)

``pip install .`` compiles every native op (csrc/, pybind11 headers only, no torch) with ninja into
``dsplug/csrc/prebuilt/``, where the runtime finds them, so that no op builds at first use. The op
builder itself (core/op_builder, standard library only) does the work, so the install-time build
and the runtime agree on the cache key. ``DSPLUG_BUILD_OPS=0`` skips the step; an op that cannot
be built here is reported and builds at first use (or falls back to pure torch). An editable
install builds nothing (ops build at first use or with ``dsplug build-ops``). pip shows what was
built with ``pip install -v .``; ``dsplug report`` shows it too ("built at install").
All metadata lives in pyproject.toml.
"""
import os
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

FOLDERS = {"dsplug": "core", "dsplug.plugins": "plugins", "dsplug.csrc": "csrc"}
BUILD_OPS_ENV = "DSPLUG_BUILD_OPS"


def _packages():
    names = []
    for package, folder in FOLDERS.items():
        names.append(package)
        names += [f"{package}.{sub}" for sub in find_packages(folder)]
    return names


def _say(message):
    print(f"dsplug install: {message}", flush=True)


def _op_builder(package_dir):
    """``dsplug.op_builder`` from the copy being installed, without running ``dsplug/__init__.py``
    (which needs the runtime dependencies): a bare ``dsplug`` package over ``package_dir``."""
    for name in [n for n in sys.modules if n == "dsplug" or n.startswith("dsplug.")]:
        del sys.modules[name]
    bare = types.ModuleType("dsplug")
    bare.__path__ = [package_dir]
    sys.modules["dsplug"] = bare
    import dsplug.op_builder

    return dsplug.op_builder


def build_native_ops(package_dir):
    """Compile every op into ``<package_dir>/csrc/prebuilt``; report each build. Never fails the
    install: an op not built here builds at first use."""
    if os.environ.get(BUILD_OPS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        _say(f"native ops not built ({BUILD_OPS_ENV}=0); they build at first use or with `dsplug build-ops`")
        return
    saved = {n: m for n, m in sys.modules.items() if n == "dsplug" or n.startswith("dsplug.")}
    try:
        ob = _op_builder(package_dir)
        root = ob.builder.prebuilt_root()
        builds = {}  # one build per build name (the three CPU optimizers share one)
        for name in sorted(ob.ALL_OPS):
            builder = ob.ALL_OPS[name]()
            why = builder.incompatibility()
            if why:
                _say(f"native op {name} not built: {why}; it uses its pure-torch fallback")
                continue
            builds.setdefault(builder.build_name(), []).append(builder)

        def build(group):
            started = time.perf_counter()
            try:
                group[0].build(root=root)
            except Exception as exc:  # noqa: BLE001 - a failed op must not fail the install
                return group, None, str(exc).strip().splitlines()[0]
            return group, time.perf_counter() - started, None

        _say(f"building native ops {', '.join(sorted(builds))} with ninja (pybind11 headers; "
             f"{BUILD_OPS_ENV}=0 skips this)")
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(builds) or 1) as pool:
            for group, seconds, error in pool.map(build, builds.values()):
                ops = ", ".join(b.NAME for b in group)
                if error:
                    _say(f"native op(s) {ops} not built ({error}); they build at first use")
                else:
                    _say(f"built native op(s) {ops} ({group[0].backend_detail()}) in {seconds:.1f} s")
        _keep_only_libraries(root, ob.builder.LIBRARY_META)
        _say(f"native ops done in {time.perf_counter() - started:.1f} s, in {root}")
    finally:
        for name in [n for n in sys.modules if n == "dsplug" or n.startswith("dsplug.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _keep_only_libraries(root, meta):
    """Leave the libraries and their build.json in the package; drop objects, ninja files, locks."""
    import shutil

    if not os.path.isdir(root):
        return
    for entry in os.scandir(root):
        if not entry.is_dir() or entry.name.startswith("."):
            shutil.rmtree(entry.path) if entry.is_dir() else os.remove(entry.path)
            continue
        for item in os.scandir(entry.path):
            if item.is_dir():
                shutil.rmtree(item.path)
            elif not (item.name == meta or item.name.endswith((".so", ".pyd", ".dylib"))):
                os.remove(item.path)


class BuildPyWithNativeOps(build_py):
    """The pure-Python build, then the native ops into the built package."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            build_native_ops(os.path.join(os.path.abspath(self.build_lib), "dsplug"))


class BinaryDistribution(Distribution):
    """The wheel holds compiled ops: tag it for this platform and Python, not as pure Python."""

    def has_ext_modules(self):
        return True


setup(
    package_dir=FOLDERS,
    packages=_packages(),
    package_data={"dsplug.csrc": ["**/*.cpp", "**/*.h", "*.cpp", "*.h"], "dsplug": ["data/*", "**/*.json", "**/*.txt"],
                  "dsplug.plugins.train": ["default_config.json", "data/*"]},
    include_package_data=True,
    cmdclass={"build_py": BuildPyWithNativeOps},
    distclass=BinaryDistribution,
)
