"""Shared test helpers."""
from __future__ import annotations

import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("DSPLUG_BLOCK_PLUGINS", raising=False)
    return os.environ
