"""``dsplug deepspeed-alias``: the opt-in ``deepspeed`` name (imports, metadata, launcher command).

Most tests act on a fresh, throwaway virtual environment (``python -m venv --without-pip``, no
network, nothing installed): a ``.pth`` file makes this interpreter's site-packages (torch, pluggy,
dsplug) visible to it, and ``python -m dsplug.cli deepspeed-alias ...`` run by the venv's own
interpreter acts on the venv, exactly as a user's ``dsplug deepspeed-alias enable`` acts on theirs.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dsplug
from dsplug.cli import main as cli_main
from dsplug.unavailable import MODULES, NAMES, ModuleNotAvailableInDsplug, NotAvailableInDsplug, module_error

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is not None,
    reason="a deepspeed is importable in the test interpreter and would leak into the throwaway venvs")

SUFFIX = f"+dsplug.{dsplug.__version__}"


class Venv:
    def __init__(self, root: Path):
        self.root = root
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        self.python = root / ("Scripts" if os.name == "nt" else "bin") / ("python.exe" if os.name == "nt" else "python")
        paths = json.loads(self.py("import json, sysconfig; print(json.dumps(sysconfig.get_paths()))").stdout)
        self.purelib = Path(paths["purelib"])
        self.scripts = Path(paths["scripts"])
        # this interpreter's site-packages (dsplug's editable finder .pth included) become the venv's too
        dirs = [d for d in dict.fromkeys([*site.getsitepackages(), *(p for p in sys.path if "-packages" in p)])
                if os.path.isdir(d)]
        lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
        (self.purelib / "_dsplug_test_parent.pth").write_text("\n".join(lines) + "\n")

    def env(self, **extra):
        env = dict(os.environ, **extra)
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # let imports leave byte-code caches for disable to clean
        env.pop("DSPLUG_BLOCK_PLUGINS", None)
        return env

    def py(self, code: str, check=False, **env) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.python), "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              env=self.env(**env), cwd=str(self.root))
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def alias(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.python), "-m", "dsplug.cli", "deepspeed-alias", *args], capture_output=True,
                              text=True, env=self.env(), cwd=str(self.root))

    def snapshot(self) -> dict:
        return {str(p.relative_to(self.root)): p.read_bytes() for p in sorted(self.root.rglob("*")) if p.is_file()}


@pytest.fixture
def venv(tmp_path):
    return Venv(tmp_path / "venv")


def test_no_effect_unless_enabled(venv):
    out = venv.py("""
        import importlib.metadata, importlib.util
        try:
            import deepspeed
        except ModuleNotFoundError as exc:
            print("import:", exc)
        try:
            importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            print("metadata: none")
        print("spec:", importlib.util.find_spec("deepspeed"))
        import dsplug
        print("dsplug:", dsplug.__name__)
        """, check=True).stdout
    assert "import: No module named 'deepspeed'" in out
    assert "metadata: none" in out and "spec: None" in out and "dsplug: dsplug" in out
    status = venv.alias("status")
    assert status.returncode == 0 and "deepspeed alias: disabled" in status.stdout
    assert "real DeepSpeed: not installed" in status.stdout
    assert not (venv.scripts / "deepspeed").exists()


CHECKS = """
    import importlib, importlib.metadata, sys
    import deepspeed
    import dsplug
    # dsplug's namespace under DeepSpeed's name, with the alias distribution's version
    assert deepspeed.initialize is dsplug.initialize and deepspeed.DeepSpeedEngine is dsplug.DeepSpeedEngine
    assert deepspeed.__version__ == importlib.metadata.version("deepspeed") != dsplug.__version__
    assert (deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__) == (0, 19, 8)
    deepspeed.patched_by_a_test = 1  # monkeypatching deepspeed.X patches dsplug.X
    assert dsplug.patched_by_a_test == 1
    del deepspeed.patched_by_a_test
    assert not hasattr(dsplug, "patched_by_a_test")
    import deepspeed.comm
    assert deepspeed.comm is dsplug.comm, "deepspeed.comm must be the same module object"
    import deepspeed.comm as dist
    assert dist is dsplug.comm and sys.modules["deepspeed.comm"] is dsplug.comm
    import deepspeed.runtime.lr_schedules
    import dsplug.runtime.lr_schedules
    assert deepspeed.runtime.lr_schedules is dsplug.runtime.lr_schedules
    assert dsplug.runtime.lr_schedules.__spec__.name == "dsplug.runtime.lr_schedules"  # own spec kept
    from deepspeed.runtime.lr_schedules import WarmupLR
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.zero import Init
    assert importlib.import_module("deepspeed.zero") is dsplug.zero
    assert deepspeed.initialize is dsplug.initialize

    version = importlib.metadata.version("deepspeed")
    assert version.endswith(SUFFIX), version
    try:
        from packaging.requirements import Requirement
        ok = Requirement("deepspeed>=0.9.3").specifier.contains(version)
    except ImportError:
        ok = tuple(int(x) for x in version.split("+")[0].split(".")[:3]) >= (0, 9, 3)
    assert ok, version
    dist = importlib.metadata.distribution("deepspeed")
    assert [ep.value for ep in dist.entry_points if ep.group == "console_scripts" and ep.name == "deepspeed"] == [
        "dsplug.plugins.deepspeed_alias.launcher:main"]
    assert "dsplug" in " ".join(dist.requires or [])

    for stmt, what in [("import deepspeed.module_inject", "deepspeed.module_inject"),
                       ("from deepspeed.sequence.layer import DistributedAttention", "deepspeed.sequence"),
                       ("import deepspeed.inference", "deepspeed.inference"),
                       ("from deepspeed import init_inference", "deepspeed.init_inference"),
                       ("deepspeed.tp_model_init", "deepspeed.tp_model_init"),
                       ("import deepspeed.linear", "deepspeed.linear")]:
        try:
            exec(stmt)
        except ImportError as exc:
            assert "not available in dsplug" in str(exc) and what in str(exc), (stmt, exc)
        else:
            raise AssertionError(stmt + " did not raise")
    try:
        import deepspeed.no_such_module
    except ModuleNotFoundError as exc:
        assert exc.name == "deepspeed.no_such_module", exc
    print("CHECKS OK", version)
"""


def test_enable_serves_dsplug_modules_metadata_and_unavailable_names(venv):
    proc = venv.alias("enable")
    assert proc.returncode == 0, proc.stderr
    assert f"deepspeed 0.19.8{SUFFIX}" in proc.stdout or SUFFIX in proc.stdout
    out = venv.py(f"SUFFIX = {SUFFIX!r}\n" + textwrap.dedent(CHECKS), check=True).stdout
    assert "CHECKS OK" in out
    status = venv.alias("status", "--json")
    info = json.loads(status.stdout)
    assert info["enabled"] and info["version"].endswith(SUFFIX) and not info["real_deepspeed"]
    assert str(venv.purelib / "deepspeed" / "__init__.py") in info["files"]
    assert str(venv.scripts / "deepspeed") in info["files"]
    text = venv.alias("status").stdout
    assert "deepspeed alias: enabled" in text and "real DeepSpeed: not installed" in text


def test_enable_is_idempotent(venv):
    assert venv.alias("enable").returncode == 0
    first = venv.snapshot()
    again = venv.alias("enable")
    assert again.returncode == 0 and "already enabled" in again.stdout
    assert venv.snapshot() == first
    assert len(list(venv.purelib.glob("deepspeed-*.dist-info"))) == 1


def test_deepspeed_command_is_dsplug_launch(venv):
    assert venv.alias("enable").returncode == 0
    script = venv.scripts / "deepspeed"
    assert script.is_file() and os.access(script, os.X_OK)
    helped = subprocess.run([str(script), "--help"], capture_output=True, text=True, env=venv.env())
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: deepspeed") and "--num_gpus" in helped.stdout
    args = ["--num_procs", "2", "--master_port", "29555", "--print_only", "train.py", "--lr", "0.1"]
    ours = subprocess.run([str(script), *args], capture_output=True, text=True, env=venv.env(), cwd=str(venv.root))
    theirs = subprocess.run([str(venv.python), "-m", "dsplug.cli", "launch", *args], capture_output=True, text=True,
                            env=venv.env(), cwd=str(venv.root))
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
    assert ours.stdout == theirs.stdout and "train.py --lr 0.1" in ours.stdout
    bad = subprocess.run([str(script), "--num_procs", "0", "t.py"], capture_output=True, text=True, env=venv.env())
    assert bad.returncode == 2 and "usage: deepspeed" in bad.stderr


ELASTIC_CONFIG = {"train_batch_size": 8, "elasticity": {"enabled": True, "max_train_batch_size": 2000,
                                                         "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
                                                         "max_gpus": 10000, "min_time": 20, "version": 0.1}}


def test_deepspeeds_other_commands_are_their_dsplug_commands(venv):
    """DeepSpeed's console scripts that map to a dsplug command, installed and removed with the alias."""
    before = venv.snapshot()
    assert venv.alias("enable").returncode == 0
    config = venv.root / "elastic.json"
    config.write_text(json.dumps(ELASTIC_CONFIG))

    def run(*argv):
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=venv.env(),
                              cwd=str(venv.root))

    for script, command, args in [("ds_report", "report", ["--help"]), ("dsr", "report", ["--help"]),
                                  ("ds_nvme_tune", "nvme-tune", ["--help"]), ("ds_elastic", "elastic", ["--help"]),
                                  ("ds_elastic", "elastic", ["-c", config, "-w", "4"]),
                                  ("deepspeed.pt", "launch", ["--print_only", "--num_procs", "2", "t.py"]),
                                  ("ds", "launch", ["--print_only", "--num_procs", "2", "t.py"])]:
        path = venv.scripts / script
        assert path.is_file() and os.access(path, os.X_OK), script
        ours = run(path, *args)
        theirs = run(venv.python, "-m", "dsplug.cli", command, *args)
        assert ours.returncode == theirs.returncode == 0, (script, ours.stderr, theirs.stderr)
        if args == ["--help"]:
            assert ours.stdout.startswith(f"usage: {script} ") and theirs.stdout.startswith(f"usage: dsplug {command} ")
            # the same help after the usage lines (which wrap by the program name's length)
            assert ours.stdout.split("\n\n", 1)[1:] == theirs.stdout.split("\n\n", 1)[1:], script
        else:
            assert ours.stdout == theirs.stdout, script
    assert "final_batch_size .... 1680" in run(venv.scripts / "ds_elastic", "-c", config, "-w", "4").stdout
    report = run(venv.scripts / "ds_report")
    assert report.returncode == 0 and report.stdout == run(venv.python, "-m", "dsplug.cli", "report").stdout
    scripts = venv.py("import importlib.metadata as m; print(sorted(ep.name for ep in "
                      "m.distribution('deepspeed').entry_points if ep.group == 'console_scripts'))", check=True)
    assert scripts.stdout.strip() == str(sorted(["deepspeed", "deepspeed.pt", "ds", "ds_elastic", "ds_nvme_tune",
                                                 "ds_report", "dsr"]))
    config.unlink()
    assert venv.alias("disable").returncode == 0
    assert venv.snapshot() == before


def test_another_tools_command_of_the_same_name_is_left_alone(venv):
    foreign = venv.scripts / "ds"
    foreign.write_text("#!/bin/sh\necho another tool\n")
    proc = venv.alias("enable")
    assert proc.returncode == 0, proc.stderr
    assert f"ds                -> not written: {foreign} exists and is not dsplug's" in proc.stdout
    assert foreign.read_text() == "#!/bin/sh\necho another tool\n" and (venv.scripts / "ds_report").is_file()
    entry_points = next(venv.purelib.glob("deepspeed-*.dist-info")) / "entry_points.txt"
    assert "\nds = " not in entry_points.read_text() and "\nds_report = " in entry_points.read_text()
    assert venv.alias("disable").returncode == 0
    assert foreign.read_text() == "#!/bin/sh\necho another tool\n" and not (venv.scripts / "ds_report").exists()


def test_disable_removes_exactly_what_enable_wrote(venv):
    before = venv.snapshot()
    assert venv.alias("enable").returncode == 0
    venv.py("import deepspeed, deepspeed.comm", check=True)  # leaves deepspeed/__pycache__ behind
    assert list((venv.purelib / "deepspeed").glob("__pycache__/*.pyc"))
    proc = venv.alias("disable")
    assert proc.returncode == 0, proc.stderr
    assert "deepspeed alias disabled" in proc.stdout
    assert venv.snapshot() == before
    assert not (venv.purelib / "deepspeed").exists() and not (venv.scripts / "deepspeed").exists()
    out = venv.py("""
        import importlib.metadata
        try:
            import deepspeed
        except ModuleNotFoundError:
            print("gone")
        try:
            importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            print("no metadata")
        """, check=True).stdout
    assert "gone" in out and "no metadata" in out
    again = venv.alias("disable")
    assert again.returncode == 0 and "not enabled" in again.stdout
    assert venv.alias("enable").returncode == 0  # and back: reversible both ways


def _fake_real_deepspeed(venv, kind: str):
    if kind == "dist-info":
        info = venv.purelib / "deepspeed-0.16.4.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.16.4\n")
        (info / "RECORD").write_text("")
    elif kind == "package":
        (venv.purelib / "deepspeed").mkdir()
        (venv.purelib / "deepspeed" / "__init__.py").write_text("__version__ = '0.16.4'\n")
    elif kind == "script":
        (venv.scripts / "deepspeed").write_text("#!/bin/sh\necho real deepspeed\n")
    else:  # egg-info of a legacy develop install
        (venv.purelib / "deepspeed.egg-info").mkdir()
        (venv.purelib / "deepspeed.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: deepspeed\n"
                                                                       "Version: 0.16.4\n")


@pytest.mark.parametrize("kind", ["dist-info", "package", "script", "egg-info"])
def test_refuses_next_to_a_real_deepspeed(venv, kind):
    _fake_real_deepspeed(venv, kind)
    before = venv.snapshot()
    proc = venv.alias("enable")
    assert proc.returncode != 0
    assert "refusing: a real DeepSpeed is installed" in proc.stderr and "pip uninstall deepspeed" in proc.stderr
    assert venv.snapshot() == before  # nothing written
    status = venv.alias("status")
    assert "real DeepSpeed: present" in status.stdout
    disabled = venv.alias("disable")
    assert disabled.returncode == 0 and "left alone" in disabled.stdout
    assert venv.snapshot() == before  # nothing removed


def test_disable_leaves_a_file_someone_else_replaced(venv):
    assert venv.alias("enable").returncode == 0
    shim = venv.purelib / "deepspeed" / "__init__.py"
    shim.write_text("# not ours any more\n")
    proc = venv.alias("disable")
    assert proc.returncode == 0
    assert shim.read_text() == "# not ours any more\n"
    assert not list(venv.purelib.glob("deepspeed-*.dist-info")) and not (venv.scripts / "deepspeed").exists()


def test_pip_uninstall_removes_the_alias(venv):
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip("pip is not available in the test interpreter")
    before = venv.snapshot()
    assert venv.alias("enable").returncode == 0
    venv.py("import deepspeed", check=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv.python), "uninstall", "-y", "deepspeed"],
                          capture_output=True, text=True, env=venv.env(PIP_DISABLE_PIP_VERSION_CHECK="1"))
    if proc.returncode != 0 and "no such option: --python" in proc.stderr:
        pytest.skip("pip older than 22.3 (no --python)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert venv.snapshot() == before


# ------------------------------------------------------------------------------ in-process


def test_target_directory_option(tmp_path):
    target = tmp_path / "site"
    assert cli_main(["deepspeed-alias", "enable", "--target", str(target)]) == 0
    info = next(target.glob("deepspeed-*.dist-info"))
    assert info.name == f"deepspeed-0.19.8{SUFFIX}.dist-info"
    rows = (info / "RECORD").read_text().splitlines()
    assert "bin/deepspeed" in (row.split(",")[0] for row in rows)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", "import deepspeed, deepspeed.unavailable, dsplug, importlib.metadata as m; "
                          "assert deepspeed.unavailable is dsplug.unavailable; print(m.version('deepspeed'))"],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip().endswith(SUFFIX), out.stderr
    assert cli_main(["deepspeed-alias", "disable", "--target", str(target)]) == 0
    assert sorted(target.rglob("*")) == [target / "bin"]  # the (empty) scripts dir enable created


def test_enable_replaces_an_alias_written_by_another_dsplug_version(tmp_path):
    from dsplug.plugins.deepspeed_alias.install import directory_target, enable, inspect

    target = directory_target(tmp_path)
    old = tmp_path / "deepspeed-0.19.8+dsplug.0.0.1.dist-info"
    old.mkdir()
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8+dsplug.0.0.1\n")
    (old / "RECORD").write_text("deepspeed-0.19.8+dsplug.0.0.1.dist-info/METADATA,,\n")
    assert inspect(target).version == "0.19.8+dsplug.0.0.1" and not inspect(target).real
    lines = enable(target)
    assert "replaced deepspeed 0.19.8+dsplug.0.0.1" in lines[0]
    assert [p.name for p in tmp_path.glob("deepspeed-*.dist-info")] == [f"deepspeed-0.19.8{SUFFIX}.dist-info"]


def test_unavailable_top_level_names_raise_a_clear_import_error():
    with pytest.raises(NotAvailableInDsplug, match=r"deepspeed\.init_inference .*not available in dsplug: "
                                                   r"DeepSpeed-Inference"):
        dsplug.init_inference
    with pytest.raises(ImportError, match="not available in dsplug: automatic tensor parallelism"):
        from dsplug import tp_model_init  # noqa: F401
    with pytest.raises(ImportError, match="Ulysses sequence parallelism"):
        dsplug.sequence
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        dsplug.no_such_name  # names DeepSpeed lacks too stay ordinary AttributeErrors
    assert not hasattr(dsplug, "no_such_name")
    assert dsplug.get_registry is importlib.import_module("dsplug.registry").get_registry


def test_unavailable_tables_name_only_what_dsplug_lacks():
    for name in NAMES:
        assert name not in dsplug._LAZY and name not in dir(dsplug), name
    for module in MODULES:
        real = "dsplug" + module[len("deepspeed"):]
        try:
            spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            spec = None
        assert spec is None, f"{module}: dsplug has {real}; delete the row"
    error = module_error("deepspeed.module_inject.auto_tp")
    assert isinstance(error, ModuleNotAvailableInDsplug) and isinstance(error, ModuleNotFoundError)
    assert error.name == "deepspeed.module_inject.auto_tp" and "AutoTP" in str(error)
    assert module_error("deepspeed.comm") is None and module_error("deepspeed") is None


def test_finder_in_process_serves_the_same_module_objects():
    from dsplug.plugins.deepspeed_alias import finder

    assert "deepspeed" not in sys.modules
    try:
        from dsplug.plugins.deepspeed_alias.install import alias_version

        module = finder.install()
        assert module.__version__ == alias_version() and module.initialize is dsplug.initialize
        assert finder.install() is module  # once on sys.meta_path
        assert sum(getattr(f, "dsplug_deepspeed_alias", False) for f in sys.meta_path) == 1
        import deepspeed
        import deepspeed.comm
        import deepspeed.utils.zero_to_fp32

        assert deepspeed is module and deepspeed.comm is importlib.import_module("dsplug.comm")
        assert deepspeed.utils.zero_to_fp32 is importlib.import_module("dsplug.utils.zero_to_fp32")
        assert importlib.import_module("dsplug.comm").__spec__.name == "dsplug.comm"
        with pytest.raises(ModuleNotAvailableInDsplug, match="LoRA"):
            import deepspeed.linear  # noqa: F401
        with pytest.raises(ModuleNotFoundError):
            import deepspeed.nothing_here  # noqa: F401
    finally:
        finder.uninstall()
    assert "deepspeed" not in sys.modules and "deepspeed.comm" not in sys.modules
    assert not finder.installed()


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir") for p in sorted(root.rglob("*"))}


def test_a_failed_enable_leaves_nothing_and_names_what_blocked_it(tmp_path, capsys):
    """`bin` (the scripts directory) is a file: enable refuses before writing anything."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "bin").write_text("a file where the scripts directory goes\n")
    before = _tree(site_dir)
    assert cli_main(["deepspeed-alias", "enable", "--target", str(site_dir)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {site_dir / 'bin' / 'deepspeed'}: {site_dir / 'bin'} is a file, not a directory" in err
    assert "nothing was changed" in err and "Traceback" not in err and "FileExistsError" not in err
    assert _tree(site_dir) == before  # no deepspeed/__init__.py, no dist-info


def test_an_enable_failing_midway_is_undone_and_restores_the_alias_it_replaced(tmp_path, monkeypatch):
    from dsplug.plugins.deepspeed_alias import install

    target = install.directory_target(tmp_path)
    old = tmp_path / "deepspeed-0.19.8+dsplug.0.0.1.dist-info"
    old.mkdir()
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8+dsplug.0.0.1\n")
    (old / "RECORD").write_text("deepspeed-0.19.8+dsplug.0.0.1.dist-info/METADATA,,\n")
    before = _tree(tmp_path)
    real_write, calls = install._write, []

    def failing_write(path, text, mode=None):
        calls.append(path)
        if len(calls) == 3:  # after the shim and the script
            raise OSError(28, "No space left on device", str(path))
        return real_write(path, text, mode)

    monkeypatch.setattr(install, "_write", failing_write)
    with pytest.raises(install.AliasError, match=r"could not write .*METADATA .*No space left on device.*nothing was "
                                                  r"left behind; the alias that was there is restored"):
        install.enable(target)
    assert _tree(tmp_path) == before
