"""What ``dsplug deepspeed-alias enable | disable | status`` do to an environment's files.

An environment is an :class:`AliasTarget`: the site-packages directory the files go into (``purelib``),
the scripts directory of the ``deepspeed`` command, and the directories searched for a real
DeepSpeed. :func:`current_target` is the running interpreter's environment (``sysconfig``).

What the alias owns is recognized, never guessed: the dist-info's version carries the local part
``+dsplug...``; the shim and the script carry :data:`MARKER` on their first lines. Anything named
``deepspeed`` without those marks is a real DeepSpeed (or someone else's file), and
:func:`enable` refuses to run next to it while :func:`disable` leaves it alone.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional

from . import DEEPSPEED_API_VERSION
from .launcher import COMMAND_SCRIPTS, ENTRY_POINTS as SCRIPT_ENTRY_POINTS

#: first-line mark of the files the alias writes (the shim, the script)
MARKER = "dsplug deepspeed-alias"
PACKAGE = "deepspeed"
SCRIPT = "deepspeed"
#: DeepSpeed's other console scripts that are a dsplug command (``ds_report`` ...); one that exists
#: and is not ours (another tool's ``ds``) is left alone and not written
OTHER_SCRIPTS = tuple(name for name in COMMAND_SCRIPTS if name != SCRIPT)
LOCAL_PREFIX = "dsplug"

_DIST_INFO = re.compile(r"^deepspeed-(?P<version>[^-]+)\.dist-info$", re.IGNORECASE)
_EGG_INFO = re.compile(r"^deepspeed(-(?P<version>[^-]+)(-py[0-9.]+)?)?\.(egg-info|egg-link|egg)$", re.IGNORECASE)


class AliasError(Exception):
    """enable / disable cannot proceed (a real DeepSpeed, or a foreign file in the way)."""


@dataclass(frozen=True)
class AliasTarget:
    purelib: Path
    scripts: Path
    #: where a real DeepSpeed is looked for, besides purelib
    extra_dirs: tuple = ()
    #: also look on the running interpreter's sys.path (the current environment)
    search_sys_path: bool = True


def current_target() -> AliasTarget:
    """The environment of ``sys.executable``: its site-packages (pure and platform) and scripts dir."""
    paths = sysconfig.get_paths()
    purelib = Path(paths["purelib"])
    platlib = paths.get("platlib")
    extra = (Path(platlib),) if platlib and Path(platlib) != purelib else ()
    return AliasTarget(purelib=purelib, scripts=Path(paths["scripts"]), extra_dirs=extra)


def directory_target(directory) -> AliasTarget:
    """A plain directory used as site-packages (``pip install --target`` style), scripts in ``DIR/bin``."""
    d = Path(directory)
    return AliasTarget(purelib=d, scripts=d / "bin", search_sys_path=False)


def dsplug_version() -> str:
    import dsplug

    return dsplug.__version__


def alias_version(version: Optional[str] = None) -> str:
    """``0.19.8+dsplug.0.1.0``: the DeepSpeed API level, dsplug's version as the PEP 440 local part."""
    local = re.sub(r"[^A-Za-z0-9]+", ".", version or dsplug_version()).strip(".")
    return f"{DEEPSPEED_API_VERSION}+{LOCAL_PREFIX}.{local}"


def is_alias_version(version: str) -> bool:
    return "+" in version and version.split("+", 1)[1].lower().startswith(LOCAL_PREFIX)


def _has_marker(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            head = fh.read(512)
    except OSError:
        return False
    return any(MARKER in line for line in head.splitlines()[:5])


# ------------------------------------------------------------------------------ inspection


@dataclass
class State:
    target: AliasTarget
    #: our dist-info directories (normally one)
    dist_infos: List[Path] = field(default_factory=list)
    #: the version our dist-info reports (the first one)
    version: Optional[str] = None
    #: files our RECORDs list that exist, and those that are missing
    files: List[Path] = field(default_factory=list)
    missing: List[Path] = field(default_factory=list)
    #: descriptions of a real DeepSpeed (or foreign 'deepspeed' files); empty when none
    real: List[str] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.dist_infos)


def _read_version(info: Path, fallback: Optional[str]) -> Optional[str]:
    try:
        text = (info / "METADATA").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.lower().startswith("version:"):
            return line.split(":", 1)[1].strip()
        if not line.strip():
            break
    return fallback


def _record_paths(info: Path, purelib: Path) -> List[Path]:
    try:
        text = (info / "RECORD").read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for row in csv.reader(io.StringIO(text)):
        if row and row[0]:
            out.append(Path(os.path.normpath(purelib / row[0])))
    return out


def _is_shim_dir(pkg: Path) -> bool:
    """``deepspeed/`` holds only our shim (and its byte-code cache)."""
    init = pkg / "__init__.py"
    if not init.is_file() or not _has_marker(init):
        return False
    return all(child.name in ("__init__.py", "__pycache__") for child in pkg.iterdir())


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def inspect(target: AliasTarget) -> State:
    state = State(target=target)
    dirs = [target.purelib, *target.extra_dirs]
    for d in dirs:
        if not d.is_dir():
            continue
        for entry in sorted(d.iterdir()):
            name = entry.name
            m = _DIST_INFO.match(name)
            if m:
                version = _read_version(entry, m.group("version"))
                if version and is_alias_version(version) and _same(d, target.purelib):
                    state.dist_infos.append(entry)
                    state.version = state.version or version
                else:
                    state.real.append(f"the distribution deepspeed {version} ({entry})")
                continue
            if _EGG_INFO.match(name):
                state.real.append(f"the distribution {name} ({entry})")
            elif name.lower() == PACKAGE and entry.is_dir():
                if not _is_shim_dir(entry):
                    state.real.append(f"the package directory {entry} (not written by dsplug)")
            elif name.lower() in ("deepspeed.py",) or (name.lower().startswith("deepspeed.") and name.endswith((".so", ".pyd"))):
                state.real.append(f"the module {entry} (not written by dsplug)")
    script = target.scripts / SCRIPT
    if script.exists() and not _has_marker(script):
        state.real.append(f"the command {script} (not written by dsplug)")
    if target.search_sys_path:
        state.real.extend(_real_on_sys_path(dirs))
    seen = set()
    for info in state.dist_infos:
        for path in _record_paths(info, target.purelib) or _default_files(info, target):
            if path in seen:
                continue
            seen.add(path)
            (state.files if path.exists() else state.missing).append(path)
    # left over by an interrupted enable / a dist-info removed by hand: still ours to remove
    for path in (target.purelib / PACKAGE / "__init__.py", script, *(target.scripts / n for n in OTHER_SCRIPTS)):
        if path not in seen and path.is_file() and _has_marker(path):
            state.files.append(path)
    return state


def _real_on_sys_path(scanned: List[Path]) -> List[str]:
    """A real ``deepspeed`` this interpreter sees outside the directories :func:`inspect` scanned
    (user site-packages, ``PYTHONPATH``, a source checkout)."""
    import importlib.machinery
    import importlib.metadata

    def elsewhere(path) -> bool:
        return not any(_same(Path(path), d) for d in scanned)

    found = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name != "deepspeed" or is_alias_version(dist.version or ""):
            continue
        info = getattr(dist, "_path", None)
        if info is None or elsewhere(Path(info).parent):
            found.append(f"the distribution deepspeed {dist.version} ({info or dist.locate_file('')})")
    module = sys.modules.get(PACKAGE)
    if module is not None and getattr(module, "__name__", None) == "dsplug":
        return found  # this process already runs the alias
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE, sys.path)
    if spec is not None:
        locations = list(spec.submodule_search_locations or [])
        where = Path(spec.origin) if spec.origin else Path(locations[0]) if locations else None
        pkg_dir = where.parent if where is not None and where.name.startswith("__init__.") else where
        if where is not None and not (pkg_dir.is_dir() and _is_shim_dir(pkg_dir)) and elsewhere(pkg_dir.parent):
            found.append(f"the importable deepspeed at {where} (not written by dsplug)")
    return found


def _default_files(info: Path, target: AliasTarget) -> List[Path]:
    """What an alias writes, for a dist-info whose RECORD is gone."""
    files = [p for p in info.iterdir()] if info.is_dir() else []
    return files + [target.purelib / PACKAGE / "__init__.py", target.scripts / SCRIPT] + [
        target.scripts / name for name in OTHER_SCRIPTS if _has_marker(target.scripts / name)]


# ------------------------------------------------------------------------------ file contents


def shim_source(version: str) -> str:
    return f'''# {MARKER}: written by `dsplug deepspeed-alias enable` (deepspeed {version}); `dsplug deepspeed-alias disable` removes it.
"""The ``deepspeed`` name served by dsplug: ``import deepspeed`` is ``dsplug`` itself and every
``deepspeed.X`` is the module object ``dsplug.X`` (see dsplug.plugins.deepspeed_alias)."""
try:
    from dsplug.plugins.deepspeed_alias.finder import install as _install
except ImportError as _exc:
    raise ImportError(
        "this 'deepspeed' is dsplug's alias (written by 'dsplug deepspeed-alias enable') but dsplug cannot be "
        f"imported ({{_exc}}); reinstall dsplug, or remove the alias with 'pip uninstall deepspeed'") from _exc

_install()
'''


def _shebang(python: str) -> str:
    if " " not in python and len(python) < 120:
        return f"#!{python}\n"
    # the /bin/sh trampoline pip uses for interpreters a shebang line cannot hold
    return "#!/bin/sh\n'''exec' " + f'"{python}"' + ' "$0" "$@"\n' + "' '''\n"


def script_source(version: str, python: Optional[str] = None) -> str:
    return (_shebang(python or sys.executable)
            + f"# {MARKER}: the deepspeed launcher command, i.e. `dsplug launch` (deepspeed {version}); "
              "`dsplug deepspeed-alias disable` removes it.\n"
              "import sys\n\n"
              "from dsplug.plugins.deepspeed_alias.launcher import main\n\n"
              "if __name__ == \"__main__\":\n"
              "    sys.exit(main())\n")


def command_script_source(version: str, script: str, python: Optional[str] = None) -> str:
    """DeepSpeed's console script ``script`` (``ds_report`` ...): its dsplug command."""
    return (_shebang(python or sys.executable)
            + f"# {MARKER}: DeepSpeed's {script} command, i.e. `dsplug {COMMAND_SCRIPTS[script]}` (deepspeed "
              f"{version}); `dsplug deepspeed-alias disable` removes it.\n"
              "import sys\n\n"
              "from dsplug.plugins.deepspeed_alias.launcher import run_command\n\n"
              "if __name__ == \"__main__\":\n"
              f"    sys.exit(run_command({script!r}))\n")


def metadata_text(version: str, dsplug_ver: str) -> str:
    return (
        "Metadata-Version: 2.1\n"
        "Name: deepspeed\n"
        f"Version: {version}\n"
        f"Summary: The deepspeed name served by dsplug {dsplug_ver} (DeepSpeed API {DEEPSPEED_API_VERSION}); "
        "written by 'dsplug deepspeed-alias enable'\n"
        "License: Apache-2.0\n"
        f"Requires-Dist: dsplug=={dsplug_ver}\n"
        "\n"
        "Not DeepSpeed: an alias that makes `import deepspeed` resolve to dsplug's modules and\n"
        "`deepspeed` run `dsplug launch`. Remove it with `dsplug deepspeed-alias disable` (or\n"
        "`pip uninstall deepspeed`).\n"
    )


def entry_points_text(skipped: Iterable[str] = ()) -> str:
    """``entry_points.txt``: the console scripts written (``pip uninstall`` removes the ones it lists)."""
    skipped = set(skipped)
    return "[console_scripts]\n" + "".join(f"{name} = dsplug.plugins.deepspeed_alias.launcher:{attr}\n"
                                           for name, attr in SCRIPT_ENTRY_POINTS.items() if name not in skipped)



def _hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
    return f"sha256={digest}"


def _write(path: Path, text: str, mode: Optional[int] = None) -> bytes:
    data = text.encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.dsplug-tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)
    return data


def _rel(path: Path, base: Path) -> str:
    return os.path.relpath(path, base).replace(os.sep, "/")


# ------------------------------------------------------------------------------ actions


def _refusal(state: State, action: str) -> str:
    lines = [f"dsplug deepspeed-alias {action}: refusing: a real DeepSpeed is installed in this environment:"]
    lines += [f"  - {what}" for what in state.real]
    lines.append("The alias only serves 'deepspeed' where DeepSpeed itself is absent; uninstall it first "
                 "(pip uninstall deepspeed) to let dsplug serve the name.")
    return "\n".join(lines)


def enable(target: Optional[AliasTarget] = None) -> List[str]:
    """Write the shim, the dist-info and the ``deepspeed`` command; returns report lines.

    Idempotent: an existing alias (of any dsplug version) is replaced by the current one.
    Raises :class:`AliasError` next to a real DeepSpeed. All or nothing: a path that cannot be
    written (``bin`` is a file, a read-only directory) is named in an :class:`AliasError` and the
    environment is left as it was (files written are removed, a replaced alias restored).
    """
    target = target or current_target()
    state = inspect(target)
    if state.real:
        raise AliasError(_refusal(state, "enable"))
    dsplug_ver = dsplug_version()
    version = alias_version(dsplug_ver)
    previous = state.version if state.enabled else None
    purelib = target.purelib
    shim = purelib / PACKAGE / "__init__.py"
    script = target.scripts / SCRIPT
    info = purelib / f"deepspeed-{version}.dist-info"
    # DeepSpeed's other commands: written unless another tool's file has the name
    skipped = [target.scripts / n for n in OTHER_SCRIPTS
               if (target.scripts / n).exists() and not _has_marker(target.scripts / n)]
    contents = {
        shim: (shim_source(version), None),
        script: (script_source(version), 0o755),
        info / "METADATA": (metadata_text(version, dsplug_ver), None),
        info / "INSTALLER": ("dsplug\n", None),
        info / "entry_points.txt": (entry_points_text({p.name for p in skipped}), None),
        info / "top_level.txt": (f"{PACKAGE}\n", None),
    }
    for name in OTHER_SCRIPTS:
        if target.scripts / name not in skipped:
            contents[target.scripts / name] = (command_script_source(version, name), 0o755)
    for path in [*contents, info / "RECORD"]:
        problem = _unwritable(path)
        if problem:
            raise AliasError(f"dsplug deepspeed-alias enable: cannot write {path}: {problem}; nothing was changed")
    with _Transaction(state) as txn:
        if state.enabled:
            _remove(state)
        written = {path: txn.write(path, text, mode) for path, (text, mode) in contents.items()}
        record = io.StringIO()
        rows = csv.writer(record, lineterminator="\n")
        for path, data in written.items():
            rows.writerow([_rel(path, purelib), _hash(data), len(data)])
        rows.writerow([_rel(info / "RECORD", purelib), "", ""])
        txn.write(info / "RECORD", record.getvalue())
    verb = ("already enabled; refreshed" if previous == version
            else f"enabled (replaced deepspeed {previous})" if previous else "enabled")
    return [f"deepspeed alias {verb}: deepspeed {version} (DeepSpeed API {DEEPSPEED_API_VERSION}, dsplug {dsplug_ver})",
            f"  import deepspeed  -> dsplug ({shim})",
            f"  deepspeed command -> dsplug launch ({script})",
            *(f"  {name:<17} -> dsplug {COMMAND_SCRIPTS[name]} ({target.scripts / name})"
              for name in OTHER_SCRIPTS if target.scripts / name not in skipped),
            *(f"  {path.name:<17} -> not written: {path} exists and is not dsplug's" for path in skipped),
            f"  metadata          -> {info}",
            "undo with: dsplug deepspeed-alias disable"]


def _unwritable(path: Path) -> Optional[str]:
    """Why ``path`` cannot be written as a file (None: nothing in the way that can be seen now)."""
    if path.is_dir():
        return f"{path} is a directory"
    existing = next((p for p in path.parents if os.path.lexists(p)), None)
    if existing is None:
        return None
    if not existing.is_dir():
        kind = "a broken symbolic link" if existing.is_symlink() and not existing.exists() else "a file"
        return f"{existing} is {kind}, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


class _Transaction:
    """The files :func:`enable` writes, undone together when any step fails: new files and the
    directories made for them are removed, the files of a replaced alias are written back."""

    def __init__(self, state: State):
        self.saved = {}
        for path in [*state.files, *(f for info in state.dist_infos if info.is_dir() for f in info.iterdir())]:
            try:
                self.saved[path] = (path.read_bytes(), path.stat().st_mode & 0o777)
            except OSError:
                pass
        self.created_files: List[Path] = []
        self.created_dirs: List[Path] = []
        self.writing: Optional[Path] = None

    def write(self, path: Path, text: str, mode: Optional[int] = None) -> bytes:
        self.writing = path
        missing = [p for p in reversed(path.parents) if not os.path.lexists(p)]
        self.created_dirs.extend(missing)
        self.created_files.append(path)
        return _write(path, text, mode)

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None:
            return False
        for path in reversed(self.created_files):
            for leftover in (path, path.with_name(f".{path.name}.dsplug-tmp")):
                try:
                    leftover.unlink()
                except OSError:
                    pass
        for directory in reversed(self.created_dirs):
            _rmdir(directory)
        restored = []
        for path, (data, mode) in self.saved.items():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                os.chmod(path, mode)
                restored.append(path)
            except OSError:
                pass
        if isinstance(exc, OSError):
            what = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
            raise AliasError(f"dsplug deepspeed-alias enable: could not write {self.writing} ({what}); nothing was "
                             f"left behind" + ("; the alias that was there is restored" if restored else "")) from exc
        return False


def _remove(state: State) -> List[Path]:
    """Remove what our dist-infos record (only files that are still ours); returns what was removed."""
    purelib = state.target.purelib
    removed: List[Path] = []
    shim_dir = purelib / PACKAGE
    for path in state.files:
        inside_info = any(path.parent == info for info in state.dist_infos)
        if not inside_info and not _has_marker(path):
            continue  # replaced by someone else since: not ours to delete
        path.unlink(missing_ok=True)
        removed.append(path)
    cache = shim_dir / "__pycache__"
    if cache.is_dir() and not (shim_dir / "__init__.py").exists():
        for pyc in cache.glob("__init__.*.pyc"):
            pyc.unlink()
            removed.append(pyc)
        _rmdir(cache)
    _rmdir(shim_dir)
    for info in state.dist_infos:
        if info.is_dir():
            shutil.rmtree(info)
            removed.append(info)
    return removed


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # absent or not empty: not ours alone


def disable(target: Optional[AliasTarget] = None) -> List[str]:
    """Remove exactly what :func:`enable` wrote; a real DeepSpeed is left alone. Idempotent."""
    target = target or current_target()
    state = inspect(target)
    if not state.enabled and not state.files:
        lines = ["deepspeed alias: not enabled; nothing to remove"]
        if state.real:
            lines.append("a real DeepSpeed is installed and was left alone: " + "; ".join(state.real))
        return lines
    removed = _remove(state)
    lines = [f"deepspeed alias disabled: removed deepspeed {state.version or '(leftover files)'}"]
    lines += [f"  removed {p}" for p in removed]
    kept = [p for p in state.files if p.exists() and p not in removed and not any(p.is_relative_to(i) for i in state.dist_infos)]
    lines += [f"  left {p} (no longer written by dsplug)" for p in kept]
    if state.real:
        lines.append("a real DeepSpeed is installed and was left alone: " + "; ".join(state.real))
    return lines


def status(target: Optional[AliasTarget] = None) -> dict:
    target = target or current_target()
    state = inspect(target)
    return {
        "enabled": state.enabled,
        "version": state.version,
        "current_version": alias_version(),
        "deepspeed_api_version": DEEPSPEED_API_VERSION,
        "site_packages": str(target.purelib),
        "scripts": str(target.scripts),
        "files": [str(p) for p in state.files],
        "missing": [str(p) for p in state.missing],
        "real_deepspeed": list(state.real),
    }


def format_status(info: dict) -> Iterable[str]:
    if info["enabled"]:
        yield f"deepspeed alias: enabled (deepspeed {info['version']})"
        if info["version"] != info["current_version"]:
            yield (f"  written by another dsplug version; 'dsplug deepspeed-alias enable' updates it to "
                   f"{info['current_version']}")
        if info["missing"]:
            yield "  incomplete: missing " + ", ".join(info["missing"]) + " ('dsplug deepspeed-alias enable' repairs it)"
        yield "  files:"
        for path in info["files"]:
            yield f"    {path}"
    else:
        yield "deepspeed alias: disabled ('dsplug deepspeed-alias enable' serves the deepspeed name from dsplug)"
        if info["files"]:
            yield "  leftover files ('dsplug deepspeed-alias disable' removes them): " + ", ".join(info["files"])
        yield f"  would report: deepspeed {info['current_version']}"
    yield f"  site-packages: {info['site_packages']}"
    yield f"  scripts: {info['scripts']}"
    if info["real_deepspeed"]:
        yield "  real DeepSpeed: present (" + "; ".join(info["real_deepspeed"]) + ")"
    else:
        yield "  real DeepSpeed: not installed"
