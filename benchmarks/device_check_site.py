"""Make dsplug importable from this working tree without pip or setuptools (the device check's
fallback when the offline editable install fails).

    python benchmarks/device_check_site.py /tmp/device_check_site && export PYTHONPATH=/tmp/device_check_site

Builds, in the given folder, the layout setup.py describes out of symbolic links (``dsplug`` ->
the files of ``core/``, ``dsplug/plugins`` -> ``plugins/``, ``dsplug/csrc`` -> ``csrc/``) and a
``dsplug-<version>.dist-info`` whose ``entry_points.txt`` is pyproject.toml's, so that the
registry finds the built-in plugins through the entry-point group ``dsplug`` as it does after an
install.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


def build(site: Path) -> Path:
    project = _pyproject()["project"]
    if site.exists():
        shutil.rmtree(site)
    package = site / "dsplug"
    package.mkdir(parents=True)
    for entry in (REPO / "core").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "plugins").symlink_to(REPO / "plugins")
    (package / "csrc").symlink_to(REPO / "csrc")
    info = site / f"dsplug-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: dsplug\nVersion: {project['version']}\n")
    sections = [("dsplug", project.get("entry-points", {}).get("dsplug", {})),
                ("console_scripts", project.get("scripts", {}))]
    lines = []
    for group, entries in sections:
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    (info / "RECORD").write_text("")
    return site


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} SITE_FOLDER")
    print(f"dsplug: site at {build(Path(sys.argv[1]))}")
