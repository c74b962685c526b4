"""Every code block of README.md and docs/*.md runs as a test, so the documentation cannot rot.

Each fenced block is found by its fence; what happens to it depends on its language and on an
HTML comment on the line right before it, ``<!-- doc-test: ... -->`` (a *marker*):

=============  ==================================================================================
``python``     run as a script in a fresh interpreter (working directory: a temporary directory;
               native ops disabled, so a first run compiles nothing and the runtime stays small)
``json``       parsed by dsplug's config loader and validated as a config
               (:class:`dsplug.config.DsplugConfig`); a fragment ``"section": {...}`` is
               validated as that one section (with a micro-batch size added)
``bash``       run by bash with ``-e`` in the temporary directory (``dsplug`` and ``python`` are
               this interpreter's); ``dsplug launch`` gets a free ``--master_port``
``console``    the ``$ `` lines are run as ``bash`` commands; the other lines are their output
``toml``       parsed with :mod:`tomllib`
``text``       output, formulas or file listings shown on the page: not code, counted apart
no language    a failure: say what the block is
=============  ==================================================================================

Markers:

``skip (reason)``           not run; counted and reported with its reason
``continue``                joins the previous block of the same language on the page: they run
                            as one (the id is the first block's)
``file NAME``               the block is the file ``NAME``, written into the working directory of
                            every block after it on the page; a JSON file is validated as a
                            config, a python file must be used by a later block (its name appears
                            in one)
``plugin PATH [install] [CONFIG]``
                            a plugin module (docs/writing-plugins.md): written to ``PATH`` for
                            the later blocks, imported in this process and registered in a
                            registry with the page's earlier plugins; with ``CONFIG`` (JSON) a
                            tiny engine built from it must select the module's plugin, train two
                            steps, and save and load a checkpoint. ``install`` also installs it
                            (a distribution with an entry point on ``PYTHONPATH``) for the later
                            blocks' processes
``pytest``                  a test file: run by pytest in a fresh interpreter, with the page's
                            earlier files and plugins

Blocks of docs/huggingface.md (the page about the ``deepspeed`` alias) run with the alias
enabled for their process only (``dsplug deepspeed-alias enable --target DIR``), and only when
transformers and accelerate are importable (the ``test`` extra). Every other page uses dsplug's
own import paths: ``deepspeed`` does not import there.

``python -m tests.core.test_doc_examples`` prints how many blocks were found, run and skipped.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from tests.conftest import REPO, scaled

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: pages whose blocks run with the `deepspeed` alias enabled (they are about it)
ALIAS_PAGES = {"docs/huggingface.md"}
#: seconds of a quiet machine one block may take (scaled by the machine and its load)
TIMEOUT = 180

_FENCE = re.compile(r"^(\s*)(`{3,})([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
_LANGS = {"python": "python", "py": "python", "json": "json", "bash": "bash", "sh": "bash", "shell": "bash",
          "console": "console", "toml": "toml", "text": "text"}


@dataclasses.dataclass
class Block:
    page: str          # relative to the repository: README.md, docs/x.md
    line: int          # 1-based line of the opening fence
    lang: str          # as written after the fence
    text: str
    marker: str = ""   # what follows "doc-test:" in the comment before the fence

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        return _LANGS.get(self.lang, "")

    @property
    def verb(self) -> str:
        return self.marker.split(None, 1)[0] if self.marker else ""

    @property
    def arg(self) -> str:
        parts = self.marker.split(None, 1)
        return parts[1] if len(parts) > 1 else ""


def read_blocks(path: Path) -> List[Block]:
    """The fenced blocks of one page, in order, with their markers."""
    page = path.relative_to(REPO).as_posix()
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence) and lines[end].strip().strip("`") == ""):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page}:{i + 1}: code block never closed")
        body = textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"
        prev = i - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker = _MARKER.match(lines[prev]) if prev >= 0 else None
        blocks.append(Block(page, i + 1, lang, body, marker.group(1) if marker else ""))
        i = end + 1
    return blocks


ALL_BLOCKS: List[Block] = [b for page in PAGES for b in read_blocks(page)]


# ------------------------------------------------------------------------------ what runs how
@dataclasses.dataclass
class Unit:
    """One test case: a block, or a block with the blocks that continue it."""
    blocks: List[Block]

    @property
    def first(self) -> Block:
        return self.blocks[0]

    @property
    def id(self) -> str:
        return self.first.id

    @property
    def text(self) -> str:
        return "\n".join(b.text for b in self.blocks)


def _problem(block: Block) -> Optional[str]:
    """Why a block is malformed for this test (None: fine)."""
    if not block.lang:
        return "a code block needs a language (python, json, bash, console, toml, or text for output)"
    if not block.kind:
        return f"unknown language {block.lang!r}: use one of {sorted(_LANGS)}"
    if block.marker and block.verb not in ("skip", "continue", "file", "plugin", "pytest"):
        return f"unknown marker <!-- doc-test: {block.marker} -->"
    if block.verb == "skip" and not re.fullmatch(r"\(.+\)", block.arg):
        return "a skip marker gives its reason: <!-- doc-test: skip (why) -->"
    if block.verb in ("plugin", "pytest") and block.kind != "python":
        return f"<!-- doc-test: {block.verb} --> is for python blocks"
    if block.kind == "text" and block.marker:
        return "a text block is not run: it takes no marker"
    return None


def units() -> List[Unit]:
    """The runnable units of every page (continuations joined)."""
    out: List[Unit] = []
    last: Dict[Tuple[str, str], Unit] = {}
    for block in ALL_BLOCKS:
        if block.verb == "continue":
            unit = last.get((block.page, block.kind))
            if unit is None:
                raise AssertionError(f"{block.id}: 'continue' but no earlier {block.lang} block on the page")
            unit.blocks.append(block)
            continue
        if block.kind in ("text", "") or block.verb == "skip":
            continue
        unit = Unit([block])
        out.append(unit)
        last[(block.page, block.kind)] = unit
    return out


UNITS = units()
#: the whole text of a unit (a block and its continuations), by its first block's id
_UNIT_TEXT = {u.id: u.text for u in UNITS}


def _text_of(block: Block) -> str:
    return _UNIT_TEXT.get(block.id, block.text)


def tally() -> Tuple[Counter, List[str]]:
    """Counts of blocks by how they are run, and the skipped blocks with their reasons."""
    counts: Counter = Counter()
    skipped = []
    for block in ALL_BLOCKS:
        if block.kind == "text":
            counts["text"] += 1
        elif block.verb == "skip":
            skipped.append(f"{block.id} [{block.lang}] {block.arg}")
        else:
            how = {"plugin": "plugin module", "pytest": "pytest file", "file": "file"}.get(block.verb, "")
            counts[" ".join(x for x in (block.kind, how) if x)] += 1
    return counts, skipped


def summary() -> str:
    counts, skipped = tally()
    text = counts.pop("text", 0)
    run = sum(counts.values())
    lines = [f"doc code blocks: {len(ALL_BLOCKS)} found, {run} run, {len(skipped)} skipped, "
             f"{text} text (output / formulas shown, not code)",
             "  run: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))]
    lines += ["  skipped:"] + [f"    {line}" for line in skipped]
    return "\n".join(lines)


def test_every_block_has_a_language_and_a_known_marker():
    problems = [f"{b.id}: {p}" for b in ALL_BLOCKS if (p := _problem(b))]
    assert not problems, "\n".join(problems)


def test_python_files_are_used_by_a_later_block():
    """A python ``file`` block runs through a later block of its page that names it (a command
    running it, an import)."""
    unused = []
    for i, block in enumerate(ALL_BLOCKS):
        if block.kind == "python" and block.verb == "file":
            path = Path(_path_of(block))
            names = {path.as_posix(), path.stem if path.stem != "__init__" else path.parent.name}
            later = [b for b in ALL_BLOCKS[i + 1:] if b.page == block.page and b.verb != "skip"]
            if not any(n in b.text for b in later for n in names):
                unused.append(f"{block.id}: {path} is used by no later block of the page")
    assert not unused, "\n".join(unused)


def test_report_counts(capsys):
    """Prints how many blocks were found, run and skipped (and why)."""
    counts, skipped = tally()
    assert sum(counts.values()) + len(skipped) == len(ALL_BLOCKS)
    with capsys.disabled():
        print("\n" + summary())


# ------------------------------------------------------------------------------ the page's files
def _page_context(unit: Unit) -> List[Block]:
    """The file / plugin blocks before ``unit``'s last block on its page, not part of ``unit``
    (they exist in its working directory)."""
    out = []
    for block in ALL_BLOCKS:
        if block is unit.blocks[-1]:
            break
        if block.page == unit.first.page and block.verb in ("file", "plugin") and block not in unit.blocks:
            out.append(block)
    return out


def _path_of(block: Block) -> str:
    return block.arg.split()[0]


def _plugin_options(block: Block) -> Tuple[bool, Optional[dict]]:
    rest = block.arg.split(None, 1)[1] if len(block.arg.split(None, 1)) > 1 else ""
    install = rest.startswith("install")
    if install:
        rest = rest[len("install"):].strip()
    return install, (json.loads(rest) if rest else None)


def _module_name(path: str) -> str:
    return path[:-3].replace("/", ".") if path.endswith(".py") else path


def _materialize(unit: Unit, cwd: Path) -> Tuple[List[Block], Optional[Path]]:
    """Write the page's earlier files into ``cwd``; install the ``install`` plugins into a site
    directory (returned) with an entry point each."""
    context = _page_context(unit)
    site = None
    entry_points = {}
    for block in context:
        target = cwd / _path_of(block)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_text_of(block))
        if block.verb == "plugin" and _plugin_options(block)[0]:
            if site is None:
                site = cwd.parent / (cwd.name + "-site")
            dest = site / _path_of(block)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(_text_of(block))
            entry_points[Path(_path_of(block)).stem] = _module_name(_path_of(block))
    if site is not None:
        from tests.conftest import write_distribution

        write_distribution(site, "docs-examples", "1.0", entry_points, {})
    return context, site


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def alias_dir(tmp_path_factory) -> Path:
    """The ``deepspeed`` alias written into a throwaway directory that only child processes see."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    target = tmp_path_factory.mktemp("deepspeed-alias")
    proc = subprocess.run([sys.executable, "-m", "dsplug.cli", "deepspeed-alias", "enable", "--target", str(target)],
                          capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def _env(unit: Unit, site: Optional[Path], alias: Optional[Path]) -> Dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "DSPLUG_BLOCK_PLUGINS", "ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED", "PYTHONPATH"):
        env.pop(name, None)
    paths = [str(p) for p in (alias, site) if p is not None]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([*([str(alias / "bin")] if alias else []), bindir, env.get("PATH", "")])
    env.update(DSPLUG_DISABLE_NATIVE_OPS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg")
    return env


def _run(cmd: List[str], unit: Unit, cwd: Path, env: Dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=scaled(TIMEOUT))
    assert proc.returncode == 0, (f"{unit.id}: exit status {proc.returncode}\n--- block\n{unit.text}"
                                  f"--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


# ------------------------------------------------------------------------------ runners
def run_python(unit: Unit, cwd: Path, env: Dict[str, str]) -> None:
    script = cwd / "doc_example.py"
    script.write_text(unit.text)
    _run([sys.executable, str(script)], unit, cwd, env)


def run_pytest(unit: Unit, cwd: Path, env: Dict[str, str]) -> None:
    test = cwd / "test_doc_example.py"
    test.write_text(unit.text)
    env = dict(env, PYTHONPATH=os.pathsep.join(p for p in [str(cwd), env.get("PYTHONPATH", "")] if p))
    _run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", str(test)],
         unit, cwd, env)


def _with_free_port(command: str) -> str:
    if re.search(r"\bdsplug launch\b", command) and "--master_port" not in command:
        return re.sub(r"\bdsplug launch\b", f"dsplug launch --master_port {_free_port()}", command)
    return command


def run_shell(unit: Unit, cwd: Path, env: Dict[str, str]) -> None:
    if unit.first.kind == "console":
        commands = [line[2:] for b in unit.blocks for line in b.text.splitlines() if line.startswith("$ ")]
        assert commands, f"{unit.id}: a console block shows commands as '$ command' lines"
        text = "\n".join(commands) + "\n"
    else:
        text = unit.text
    script = cwd / "doc_example.sh"
    script.write_text(_with_free_port(text))
    _run(["bash", "-e", "-o", "pipefail", str(script)], unit, cwd, env)


def validate_config(text: str, where: str) -> None:
    """Parse ``text`` with dsplug's config loader and validate it; a ``"section": {...}``
    fragment is validated as that one section."""
    import warnings

    from dsplug.config import ConfigError, DsplugConfig
    from dsplug.config.loader import load_raw

    stripped = text.strip()
    fragment = stripped.startswith('"')
    data, _ = load_raw("{" + stripped + "}" if fragment else stripped)
    assert data, f"{where}: empty config"
    if fragment:
        assert len(data) == 1, f"{where}: a fragment shows one section, this one has {sorted(data)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notes and notices are fine in a doc example
        try:
            DsplugConfig(data, world_size=1 if fragment else None)
        except ConfigError as exc:
            # a fragment shows one section: give it the one batch size a config needs, if that is all it lacks
            if not fragment or [i.path for i in exc.issues] != ["train_batch_size"]:
                raise
            DsplugConfig({**data, "train_micro_batch_size_per_gpu": 1}, world_size=1)


def run_json(unit: Unit) -> None:
    validate_config(unit.text, unit.id)


def run_toml(unit: Unit) -> None:
    import tomllib

    data = tomllib.loads(unit.text)
    entry_points = data.get("project", {}).get("entry-points", {})
    assert "dsplug" in entry_points, f"{unit.id}: the example declares no [project.entry-points.dsplug]"


def run_file(unit: Unit, cwd: Path) -> None:
    block = unit.first
    if block.kind == "json":
        validate_config(unit.text, f"{block.id} ({_path_of(block)})")
    elif block.kind == "python":
        compile(unit.text, f"{block.id} ({_path_of(block)})", "exec")


# ------------------------------------------------------------------------------ plugin modules
def _load_module(block: Block, text: str, cwd: Path):
    import importlib.util as util

    path = cwd / _path_of(block)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    name = "doc_" + re.sub(r"\W", "_", f"{block.page}_{block.line}")
    spec = util.spec_from_file_location(name, path)
    module = util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def plugin_example(path: str):
    """The plugin module of the ``<!-- doc-test: plugin PATH ... -->`` block, imported (for tests
    that run more of it, e.g. its category's contract suite)."""
    import types

    found = [b for b in ALL_BLOCKS if b.verb == "plugin" and _path_of(b) == path]
    assert len(found) == 1, f"{len(found)} plugin blocks named {path} in the docs"
    block = found[0]
    module = types.ModuleType("doc_example_" + re.sub(r"\W", "_", path[:-3]))
    module.__file__ = f"{REPO / block.page}:{block.line}"
    exec(compile(_text_of(block), module.__file__, "exec"), module.__dict__)  # noqa: S102 - our own docs
    return module


def _specs_of(module) -> List:
    from dsplug.hookspecs import CategorySpecs

    out = []
    for hook in dir(CategorySpecs):
        impl = getattr(module, hook, None)
        if hook.startswith("dsplug_") and callable(impl):
            out.extend(impl() or [])
    return out


def _check_selected(engine, spec, module) -> None:
    config = engine.config
    category, name = spec.category, spec.name
    if category in ("optimizer", "scheduler"):
        selected = getattr(config, category)
        assert selected is not None and selected.spec.name == name, f"the config did not select {category} {name}"
    elif category in ("precision", "zero_stage"):
        provided, _ = config.selection(category)
        assert provided.spec.name == name, f"the config selected {category} {provided.spec.name}, not {name}"
    elif category == "offload_device":
        zero = config.section("zero_optimization")
        devices = {getattr(getattr(zero, k, None), "device", None) for k in ("offload_optimizer", "offload_param")}
        assert name in {str(d) for d in devices}, f"the config offloads to none of {name}"
    elif category == "compression":
        assert any(p.spec.name == name for p, _ in config.compression), f"compression_training has no {name}"
    elif category in ("monitor", "observer"):
        built = [p for p in engine.events.get_plugins() if type(p).__module__ == module.__name__]
        assert built, f"the engine built no {category} {name} from the doc's module"
    elif category == "section":
        assert config.has_section(spec.section), f"the config has no {spec.section} section"


def run_plugin(unit: Unit, cwd: Path, monkeypatch) -> None:
    """Import the page's earlier plugins and this one, register them, and when the marker gives a
    config, train a tiny engine selecting this plugin and round-trip it through a checkpoint."""
    from dsplug.testing import make_registry, save_and_load, tiny_engine, train_steps

    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))
    _, config = _plugin_options(unit.first)
    context = [b for b in _page_context(unit) if b.verb == "plugin"]
    modules = [_load_module(b, _text_of(b), cwd) for b in context]
    module = _load_module(unit.first, unit.text, cwd)
    registry = make_registry(*modules, module, distribution=f"docs ({unit.first.page})")
    specs = _specs_of(module)
    for spec in specs:
        found = registry.find(spec.category, spec.name)
        assert found is not None and found.distribution.startswith("docs"), \
            f"{unit.id}: {spec.category} {spec.name} is not in the registry: " \
            + registry.miss_message(spec.category, spec.name)
    check = PLUGIN_CHECKS.get(_path_of(unit.first))
    assert config is not None or check is not None or _plugin_options(unit.first)[0], \
        f"{unit.id}: give the plugin a config to train with, install it for a later block, or add a check here"
    if config is not None:
        assert specs, f"{unit.id}: a config is given but the module registers no plugin spec"

        def make():
            return tiny_engine(config, registry=registry)

        engine = make()
        fresh = None
        try:
            for spec in specs:
                if spec.category != "accelerator":
                    _check_selected(engine, spec, module)
            losses = train_steps(engine, 2)
            assert all(math.isfinite(x) for x in losses), losses
            fresh = save_and_load(engine, cwd / "checkpoints", make)
            assert fresh.global_steps == engine.global_steps
            train_steps(fresh, 1)
        finally:
            engine.destroy()
            if fresh is not None:
                fresh.destroy()
    if check is not None:
        check(module, registry, cwd)


def _check_section_attributes(module, registry, cwd):
    from dsplug.config import ConfigError, DsplugConfig
    from dsplug.runtime.config import DeepSpeedConfig

    config = DsplugConfig({"train_batch_size": 1, "my_tuning": {"enabled": True, "level": 2}}, registry=registry)
    assert module.my_tuning_attributes(config) == {"my_tuning_enabled": True, "my_tuning_params": {"level": 2}}
    ds = DeepSpeedConfig(config, world_size=1)
    assert ds.my_tuning_enabled is True and ds.my_tuning_params == {"level": 2}
    with pytest.raises(ConfigError, match="my_tuning.level: level 3 does not work with ZeRO stage 3"):
        DsplugConfig({"train_batch_size": 1, "my_tuning": {"level": 3}, "zero_optimization": {"stage": 3}},
                     registry=registry)


def _check_accelerator(module, registry, cwd):
    from dsplug.testing import contract_problems

    assert contract_problems("accelerator", module.XpuAccelerator()) == []
    import torch

    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        assert registry.find("accelerator", "xpu").spec.factory().is_available() is False


def _check_estimates(module, registry, cwd):
    from dsplug.config import DsplugConfig, fill_auto

    config = DsplugConfig({"train_batch_size": 8, "zero_optimization": {"stage": 4}}, world_size=8, registry=registry)
    answer = registry.pm.hook.dsplug_estimate_model_state_bytes(num_params=1000, world_size=8, config=config)
    assert answer["device"]["total"] == 16 * 1000, answer
    other = DsplugConfig({"train_batch_size": 8, "zero_optimization": {"stage": 2}}, world_size=8, registry=registry)
    assert module.dsplug_estimate_model_state_bytes(num_params=1000, world_size=8, config=other) is None
    filled = fill_auto({"my_tuning": {"bucket_size": "auto"}}, hidden_size=64, registry=registry)
    assert filled["my_tuning"]["bucket_size"] == 64 * 64


def _check_batch_sizes(module, registry, cwd):
    from dsplug.config import ConfigError, DsplugConfig

    config = DsplugConfig({"my_batching": {"enabled": True, "batch": 8, "micro": 2}}, world_size=2, registry=registry)
    assert (config.kernel.train_batch_size, config.kernel.train_micro_batch_size_per_gpu,
            config.kernel.gradient_accumulation_steps) == (8, 2, 2)
    with pytest.raises(ConfigError, match="my_batching.batch: 8 does not split over 3 ranks"):
        DsplugConfig({"my_batching": {"enabled": True, "batch": 8, "micro": 2}}, world_size=3, registry=registry)


def _check_rank_local(module, registry, cwd):
    from dsplug.testing import tiny_engine, tiny_model, train_steps

    model = tiny_model()
    model[2].bias.rank_local = True
    groups = [{"params": [p for p in model.parameters() if p is not model[2].bias]}, {"params": [model[2].bias]}]
    engine = tiny_engine({"zero_optimization": {"stage": 2}}, registry=registry, model=model, model_parameters=groups)
    try:
        assert "local" in engine.reduction_groups
        reduction = registry.pm.hook.dsplug_param_reduction(param=model[2].bias, context=engine.context)
        assert reduction is not None and reduction.divisor == 1
        assert all(math.isfinite(x) for x in train_steps(engine, 2))
    finally:
        engine.destroy()


#: more checks for particular plugin examples, by the file the marker names
PLUGIN_CHECKS = {
    "xpu_accelerator.py": _check_accelerator,
    "my_tuning.py": _check_section_attributes,
    "estimates.py": _check_estimates,
    "my_batching.py": _check_batch_sizes,
    "rank_local.py": _check_rank_local,
}


# ------------------------------------------------------------------------------ the test
@pytest.mark.parametrize("unit", UNITS, ids=[u.id for u in UNITS])
def test_doc_example(unit: Unit, tmp_path, monkeypatch, request):
    block = unit.first
    if block.kind == "json" and block.verb != "file":
        return run_json(unit)
    if block.kind == "toml":
        return run_toml(unit)
    cwd = tmp_path / "work"
    cwd.mkdir()
    if block.verb == "file":
        return run_file(unit, cwd)
    _, site = _materialize(unit, cwd)
    if block.verb == "plugin":
        return run_plugin(unit, cwd, monkeypatch)
    alias = request.getfixturevalue("alias_dir") if block.page in ALIAS_PAGES else None
    env = _env(unit, site, alias)
    if block.verb == "pytest":
        return run_pytest(unit, cwd, env)
    if block.kind == "python":
        return run_python(unit, cwd, env)
    if block.kind in ("bash", "console"):
        return run_shell(unit, cwd, env)
    raise AssertionError(f"{unit.id}: no runner for a {block.lang} block")


if __name__ == "__main__":
    print(summary())
