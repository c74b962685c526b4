"""Shared test helpers."""
from __future__ import annotations

import os
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]

# CI runs the same examples every time (a failure there reproduces here); DSPLUG_HYPOTHESIS=random
# explores new ones.
settings.register_profile("dsplug", derandomize=os.environ.get("DSPLUG_HYPOTHESIS") != "random",
                          print_blob=True)
settings.load_profile("dsplug")

# A shell starts a background job ("tox &", "nohup ... &") with SIGINT ignored, and every process
# the tests start would inherit that: the Ctrl-C tests' SIGINT would then be ignored and the run
# they interrupt would go on to its last step. The tests' children get SIGINT's default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def write_distribution(site: Path, name: str, version: str, entry_points: dict, modules: dict) -> Path:
    """Create an installed-looking distribution in ``site``: a dist-info with entry points in
    the ``dsplug`` group, plus the given module files (name -> source)."""
    site.mkdir(parents=True, exist_ok=True)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = ["[dsplug]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    return site


@pytest.fixture
def temp_site(tmp_path, monkeypatch):
    """A directory on sys.path where tests drop throwaway distributions."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    yield site
    for mod in [m for m, v in list(sys.modules.items()) if getattr(v, "__file__", "") and str(site) in str(v.__file__)]:
        sys.modules.pop(mod, None)


# ------------------------------------------------------------------------------ timeouts that scale
#: environment variable: a factor (>= 1) for every timeout of the test harness; when unset, the
#: session measures one (below) and sets it, so that the processes tests start inherit it
TIMEOUT_SCALE_ENV = "DSPLUG_TEST_TIMEOUT_SCALE"
#: seconds the calibration workload takes on a quiet 2-core machine (best of three)
_CALIBRATION_REFERENCE_S = 0.1


def _calibration_work() -> float:
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        total = 0
        for i in range(300_000):
            total += i * i
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        for _ in range(20):
            a = torch.tanh(a @ a)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def static_timeout_scale() -> float:
    """This machine's factor for timeouts: ``DSPLUG_TEST_TIMEOUT_SCALE`` when set, else how much
    slower than the reference a short CPU workload ran at session start (at least 1)."""
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise pytest.UsageError(f"{TIMEOUT_SCALE_ENV}={raw!r}: expected a number >= 1 (e.g. 3)") from None
        if not value >= 1:
            raise pytest.UsageError(f"{TIMEOUT_SCALE_ENV}={raw!r}: expected a number >= 1 (e.g. 3)")
        return value
    measured = min(_calibration_work() for _ in range(3))
    return max(1.0, round(measured / _CALIBRATION_REFERENCE_S, 2))


def load_factor() -> float:
    """How oversubscribed the CPUs are now: the 1-minute load average per core (at least 1)."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def timeout_factor() -> float:
    """The factor a timeout gets now: the machine's (:func:`static_timeout_scale`, fixed for the
    session) or the current load's, whichever is larger."""
    static = float(os.environ.get(TIMEOUT_SCALE_ENV) or 1.0)
    return max(static, load_factor())


def scaled(seconds: float) -> float:
    """``seconds`` scaled for this machine and its load now (a timeout given once, e.g. to
    ``subprocess.run``). A wait that may last long uses :class:`Deadline`, which follows the load."""
    return seconds * timeout_factor()


class Deadline:
    """A budget of ``seconds`` of a quiet machine's time: on a loaded machine it lasts longer in
    wall-clock time, by the factor the load has while waiting (re-read every slice).

        deadline = Deadline(180)
        while not done() and not deadline.expired():
            time.sleep(0.1)
    """

    def __init__(self, seconds: float):
        import time

        self.budget = float(seconds)
        self.used = 0.0
        self._last = time.monotonic()

    def expired(self) -> bool:
        import time

        now = time.monotonic()
        self.used += (now - self._last) / timeout_factor()
        self._last = now
        return self.used >= self.budget

    def slice(self, longest: float = 1.0) -> float:
        """Seconds to wait before asking again."""
        return max(0.01, min(longest, (self.budget - self.used) * timeout_factor()))


# ------------------------------------------------------------------------------ the quick subset
#: test files (by name, wherever they live under tests/) whose in-process tests form the quick
#: subset: ``pytest -m quick`` / ``tox -e quick``, under 3 minutes on a quiet 2-core machine.
#: Tests marked ``slow`` or ``multiprocess`` in them are left out.
QUICK_FILES = ("test_config.py", "test_cli.py", "test_kernel_contracts.py", "test_schedulers.py", "test_optimizers.py",
               "test_engine.py", "test_engine_plugins.py", "test_zero12.py", "test_zero3.py", "test_testing.py",
               "test_dist_harness.py", "test_checkpoint_*.py")


def pytest_collection_modifyitems(config, items):
    import fnmatch

    for item in items:
        name = os.path.basename(str(item.fspath))
        if any(fnmatch.fnmatch(name, pattern) for pattern in QUICK_FILES) and \
                not item.get_closest_marker("slow") and not item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.quick)


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: part of the quick subset (tox -e quick; pytest -m quick)")
    if not os.environ.get(TIMEOUT_SCALE_ENV, "").strip():
        os.environ[TIMEOUT_SCALE_ENV] = str(static_timeout_scale())  # inherited by the processes tests start
    else:
        static_timeout_scale()  # validates it


def pytest_report_header(config):
    return (f"dsplug test timeouts: x{os.environ.get(TIMEOUT_SCALE_ENV)} ({TIMEOUT_SCALE_ENV}), and more while the "
            f"load average per core is higher (now {load_factor():.1f})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("DSPLUG_BLOCK_PLUGINS", raising=False)
    return os.environ
