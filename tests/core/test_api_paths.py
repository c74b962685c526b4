"""The import finder of :mod:`dsplug.api_paths`: every DeepSpeed import path a plugin declares
(``dsplug_api_modules``) imports, exposes its plugin's names, works with ``dir`` / ``inspect`` /
pickle / the ``deepspeed`` alias, honours ``DSPLUG_BLOCK_PLUGINS``, and no forwarder file remains
in core/."""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import dsplug
from dsplug.api_paths import ApiPathError, ApiPathFinder
from dsplug.registry import get_registry
from dsplug.unavailable import ModuleNotAvailableInDsplug

from tests.conftest import REPO, write_distribution

CORE = REPO / "core"
DECLARED = get_registry().api_paths()
PACKAGES = sorted(get_registry().api_packages())


def _public(module):
    return [n for n in dir(module) if not n.startswith("_")]


def _run(code: str, env_extra=None, path_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("DSPLUG_BLOCK_PLUGINS", None)
    env.update(env_extra or {})
    if path_extra:
        env["PYTHONPATH"] = os.pathsep.join([str(path_extra), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=str(REPO))


def test_the_builtins_declare_the_deepspeed_paths():
    # a floor, so that the enumerating tests below cannot pass on an empty table
    assert len(DECLARED) >= 45
    for path in ("dsplug.zero", "dsplug.moe.layer", "dsplug.runtime.pipe.engine", "dsplug.runtime.zero",
                 "dsplug.runtime.lr_schedules", "dsplug.ops.adam", "dsplug.utils.zero_to_fp32"):
        assert path in DECLARED, path


@pytest.mark.parametrize("path", sorted(DECLARED))
def test_every_declared_path_imports_and_exposes_its_plugins_names(path):
    module = importlib.import_module(path)
    assert module is sys.modules[path] and module.__name__ == path
    assert importlib.import_module(path) is module
    children = {c.rsplit(".", 1)[1] for c in [*DECLARED, *PACKAGES] if c.rsplit(".", 1)[0] == path}
    kernel_own = set(vars(module)) if not isinstance(module.__spec__.loader, ApiPathFinder) else set()
    seen = set()
    listed = set(dir(module))
    for api, _origin in DECLARED[path]:
        target = importlib.import_module(api.target)
        names = [n for n in _public(target) if n not in children]
        assert names, f"{api.target} provides no names"
        for name in names:
            assert name in listed, f"dir({path}) lacks {name}"
            if name in seen or name in kernel_own:
                continue  # an earlier declarer's or the kernel module's own name wins
            assert getattr(module, name) is getattr(target, name), f"{path}.{name}"
            seen.add(name)
        exec(f"from {path} import {names[0]}", {})  # the import statement form


@pytest.mark.parametrize("package", PACKAGES)
def test_parents_of_declared_paths_are_packages_whose_children_are_attributes(package):
    module = importlib.import_module(package)
    assert hasattr(module, "__path__"), f"{package} is not a package"
    for child in [p for p in [*DECLARED, *PACKAGES] if p.rsplit(".", 1)[0] == package]:
        last = child.rsplit(".", 1)[1]
        assert last in dir(module)
        value = getattr(module, last)
        if package == "dsplug.utils" and last == "z3_leaf_module":
            assert callable(value) and not isinstance(value, types.ModuleType)  # DeepSpeed's function
            continue
        assert value is importlib.import_module(child)


def test_attribute_chains_work_right_after_import_dsplug():
    out = _run("""
        import dsplug as deepspeed
        print(deepspeed.runtime.pipe.engine.PipelineEngine.__name__)
        print(deepspeed.runtime.data_pipeline.data_routing.basic_layer.RandomLayerTokenDrop.__name__)
        print(deepspeed.moe.layer.MoE.__name__, deepspeed.profiling.flops_profiler.profiler.FlopsProfiler.__name__)
        print(deepspeed.runtime.zero.Init is deepspeed.zero.Init)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PipelineEngine", "RandomLayerTokenDrop", "MoE", "FlopsProfiler", "True"]


def test_dir_and_inspect():
    import dsplug.moe
    import dsplug.moe.layer
    from dsplug.plugins.moe import layer as plugin_layer

    assert {"MoE", "layer", "sharded_moe", "experts", "utils"} <= set(dir(dsplug.moe))
    assert "MoE" in dir(dsplug.moe.layer)
    assert inspect.getmodule(dsplug.moe.layer.MoE) is plugin_layer
    assert inspect.getsource(dsplug.moe.layer) == inspect.getsource(plugin_layer)
    assert "class MoE" in inspect.getsource(dsplug.moe.layer.MoE)
    assert inspect.getdoc(dsplug.moe.layer) == inspect.getdoc(plugin_layer)
    namespace: dict = {}
    exec("from dsplug.runtime.pipe.topology import *", namespace)
    assert "ProcessTopology" in namespace


def test_missing_names_are_attribute_errors_naming_the_provider():
    import dsplug.zero

    with pytest.raises(AttributeError, match=r"'dsplug.zero' has no attribute 'no_such'.*dsplug.plugins.zero"):
        dsplug.zero.no_such
    assert not hasattr(dsplug.zero, "no_such")
    with pytest.raises(ImportError, match="cannot import name 'no_such'"):
        exec("from dsplug.zero import no_such", {})
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dsplug.zero.no_such")
    assert not hasattr(dsplug.runtime, "no_such") and not hasattr(dsplug, "no_such")


def test_pickling_classes_and_objects_behind_declared_paths():
    from dsplug.runtime.zero.config import ZeroStageEnum
    from dsplug.runtime.zero.partition_parameters import ZeroParamStatus
    from dsplug.elasticity import ElasticityConfigError
    from dsplug.moe.layer import MoE

    assert pickle.loads(pickle.dumps(MoE)) is MoE
    assert pickle.loads(pickle.dumps(ZeroParamStatus.AVAILABLE)) is ZeroParamStatus.AVAILABLE
    assert pickle.loads(pickle.dumps(ZeroStageEnum.weights)) is ZeroStageEnum.weights
    error = pickle.loads(pickle.dumps(ElasticityConfigError("bad batch")))
    assert type(error) is ElasticityConfigError and str(error) == "bad batch"


def test_kernel_names_win_and_plugins_add_theirs():
    from dsplug.ops.adam import cpu_adam
    from dsplug.plugins.optimizers import adam_optimizer

    assert dsplug.ops.adam.DeepSpeedCPUAdam is cpu_adam.DeepSpeedCPUAdam
    assert dsplug.ops.adam.FusedAdam is adam_optimizer.FusedAdam
    assert {"DeepSpeedCPUAdam", "FusedAdam", "cpu_adam"} <= set(dir(dsplug.ops.adam))
    importlib.import_module("dsplug.utils.z3_leaf_module")  # binding the submodule keeps the function
    assert callable(dsplug.utils.z3_leaf_module) and not isinstance(dsplug.utils.z3_leaf_module, types.ModuleType)


def test_unavailable_deepspeed_modules_raise_through_the_finder():
    with pytest.raises(ModuleNotAvailableInDsplug, match=r"deepspeed\.module_inject \(dsplug\.module_inject\).*AutoTP"):
        importlib.import_module("dsplug.module_inject")
    with pytest.raises(ModuleNotAvailableInDsplug, match="Triton block-sparse"):  # below a declared path
        importlib.import_module("dsplug.ops.sparse_attention.matmul")


def test_the_deepspeed_alias_serves_the_same_module_objects():
    from dsplug.plugins.deepspeed_alias import finder

    assert "deepspeed" not in sys.modules
    try:
        finder.install()
        for path in [*DECLARED, *PACKAGES]:
            alias = "deepspeed" + path[len("dsplug"):]
            assert importlib.import_module(alias) is importlib.import_module(path), alias
            assert importlib.import_module(path).__spec__.name == path
        import deepspeed.runtime.pipe.engine as engine_module

        assert engine_module is importlib.import_module("dsplug.runtime.pipe.engine")
        with pytest.raises(ModuleNotAvailableInDsplug, match="AutoTP"):
            importlib.import_module("deepspeed.module_inject.auto_tp")
    finally:
        finder.uninstall()
    assert "deepspeed" not in sys.modules


def test_a_blocked_plugins_paths_raise_an_import_error_naming_it():
    out = _run("""
        import importlib
        import dsplug
        from dsplug.api_paths import ApiPathError, ApiPathFinder
        from dsplug.plugins.deepspeed_alias import finder
        for path in ("dsplug.moe", "dsplug.moe.layer", "dsplug.elasticity.config"):
            try:
                importlib.import_module(path)
            except ApiPathError as exc:
                print("ERR", path, "|", exc)
        print("AE", hasattr(dsplug, "moe"))
        finder.install()
        try:
            import deepspeed.moe.layer
        except ApiPathError as exc:
            print("ALIAS", exc)
        import dsplug.zero, dsplug.runtime.pipe.engine  # other plugins' paths still resolve
        print("OK", dsplug.zero.Init.__name__)
    """, {"DSPLUG_BLOCK_PLUGINS": "moe,section:elasticity"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    moe = [line for line in lines if line.startswith("ERR dsplug.moe")]
    assert len(moe) == 2 and all("DSPLUG_BLOCK_PLUGINS blocks entry point moe (dsplug)" in line for line in moe)
    elastic = next(line for line in lines if line.startswith("ERR dsplug.elasticity"))
    assert "its plugin 'elasticity' (dsplug) is blocked by DSPLUG_BLOCK_PLUGINS (section:elasticity)" in elastic
    assert "AE False" in lines
    assert any(line.startswith("ALIAS") and "entry point moe" in line for line in lines)
    assert "OK Init" in lines


def test_importing_kernel_modules_imports_no_plugin():
    out = _run("""
        import sys
        import dsplug, dsplug.config, dsplug.runtime.config, dsplug.checkpoint, dsplug.utils.logging, dsplug.ops.op_builder
        from dsplug import registry
        print(registry._REGISTRY is None, sorted(m for m in sys.modules if m.startswith("dsplug.plugins")))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "[]"]


LION_OPS = '''
class Lion8bit:
    """a third party's Lion"""
'''
LION_UTILS = '''
def helper():
    return "lion"
'''
LION_PLUGIN = '''
from dsplug import hookimpl
from dsplug.descriptors import ApiModule

@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.ops.lion", "dsplug_lion_ops"),
            ApiModule("dsplug.runtime.lion_utils", "dsplug_lion_utils"),
            ApiModule("dsplug.lion_extras.deep.tools", "dsplug_lion_utils")]
'''


def test_a_third_party_adds_names_to_a_kernel_module_and_new_paths(tmp_path):
    """The example of docs/writing-plugins.md ("DeepSpeed import paths")."""
    site = write_distribution(tmp_path / "site", "dsplug-lion", "1.0", {"lion": "dsplug_lion_plugin"},
                              {"dsplug_lion_plugin": LION_PLUGIN, "dsplug_lion_ops": LION_OPS,
                               "dsplug_lion_utils": LION_UTILS})
    code = """
        import dsplug
        import dsplug_lion_ops
        from dsplug.ops.lion import DeepSpeedCPULion, Lion8bit
        from dsplug.ops.lion.cpu_lion import DeepSpeedCPULion as kernel_lion
        from dsplug.runtime.lion_utils import helper
        import dsplug.lion_extras.deep.tools as tools
        print(Lion8bit is dsplug_lion_ops.Lion8bit, DeepSpeedCPULion is kernel_lion, helper(),
              tools.helper is helper, hasattr(dsplug.lion_extras.deep, "__path__"),
              "Lion8bit" in dir(dsplug.ops.lion))
    """
    out = _run(code, path_extra=site)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "lion", "True", "True", "True"]
    blocked = _run("import dsplug.runtime.lion_utils", {"DSPLUG_BLOCK_PLUGINS": "lion"}, path_extra=site)
    assert blocked.returncode != 0
    assert "ApiPathError" in blocked.stderr and "entry point lion (dsplug-lion)" in blocked.stderr


def test_a_plugin_importing_a_declared_path_at_import_time_is_told_why(tmp_path):
    site = write_distribution(tmp_path / "site", "eager-dist", "1.0", {"eager": "eager_plugin"},
                              {"eager_plugin": "import dsplug.moe.layer\n"})
    out = _run("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from dsplug.registry import get_registry
            registry = get_registry()
        print([b for b in registry.broken if b[0] == "eager"])
        import dsplug.moe.layer  # fine once the plugins are discovered
    """, path_extra=site)
    assert out.returncode == 0, out.stderr
    assert "imported while the plugins are being discovered" in out.stdout


# --------------------------------------------------------------------------- no forwarder comes back
def _core_modules():
    for path in sorted(CORE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _is_boilerplate(node) -> bool:
    """A docstring, ``from __future__``, an import of the finder's helper, ``__all__ = ...`` or
    ``__getattr__, __dir__ = plugin_names(__name__)``."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return True
    if isinstance(node, ast.ImportFrom) and node.module in ("__future__", "dsplug.api_paths"):
        return True
    if isinstance(node, ast.Assign):
        targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        if targets == ["__all__"]:
            return True
        call = node.value
        return isinstance(call, ast.Call) and getattr(call.func, "id", None) == "plugin_names"
    return False


def test_no_forwarder_module_in_core():
    offenders = []
    for path, tree in _core_modules():
        source = path.read_text()
        if "forward_to_plugin" in source:
            offenders.append(f"{path.relative_to(REPO)}: forward_to_plugin")
            continue
        if all(_is_boilerplate(node) for node in tree.body):
            kernel_children = path.name == "__init__.py" and any(
                p.suffix == ".py" and p.name != "__init__.py" or (p / "__init__.py").exists()
                for p in path.parent.iterdir())
            if not kernel_children:
                offenders.append(f"{path.relative_to(REPO)}: holds no kernel code")
    assert offenders == [], "serve these paths with ApiModule declarations instead:\n" + "\n".join(offenders)


def test_a_kernel_module_at_a_declared_path_takes_the_plugins_names():
    for path in DECLARED:
        rest = Path(*path.split(".")[1:])
        for candidate in (CORE / rest.with_suffix(".py"), CORE / rest / "__init__.py"):
            if candidate.exists():
                assert "plugin_names(__name__)" in candidate.read_text(), \
                    f"{path} is declared by a plugin but {candidate.relative_to(REPO)} does not take plugin names"


def test_api_module_refuses_paths_outside_dsplug():
    from dsplug.descriptors import ApiModule

    for bad in ("deepspeed.zero", "dsplug", "dsplug.plugins.zero", "dsplug.zero.", "dsplug.1x"):
        with pytest.raises(ValueError, match="ApiModule.path"):
            ApiModule(bad, "pkg.mod")
    with pytest.raises(ValueError, match="ApiModule.target"):
        ApiModule("dsplug.x", "")
    with pytest.raises(ApiPathError):
        raise ApiPathError("x")  # an ImportError subclass: `except ImportError` probes keep working
