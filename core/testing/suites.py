"""Contract test suites: pytest base classes a plugin subclasses to test itself.

::

    from dsplug.testing import MonitorContract

    class TestMyMonitor(MonitorContract):
        plugin_name = "jsonl_monitor"
        section = {"enabled": True, "output_path": "{tmp_path}", "job_name": "job"}

pytest collects the subclass (its name starts with ``Test``) and runs every ``test_*`` method
of the suite against the named plugin. The suites' own names end in ``Contract``, so importing
one into a test module does not collect it a second time.

What a subclass sets:

``plugin_name``   the name the config selects (required)
``section``       this plugin's config: the section it owns (monitor, observer, section),
                  ``optimizer.params`` / ``scheduler.params``, or its ``compression_training``
                  entry. Strings may hold ``{tmp_path}``, replaced by the test's temporary
                  directory (tests also run with that directory as the working directory).
``plugins``       plugin modules / objects not installed through an entry point, registered at
                  runtime (``Registry.register``) before the tests look the plugin up
``extra_config``  more engine config (other sections) the plugin needs
``steps``         optimizer steps per run (default 3)

Hooks a subclass may override: ``check_trained(engine, losses)`` (more checks after training),
``state_of(engine)`` (the state compared across checkpoints), ``trace(engine)`` (a value
recorded after each step and compared between a resumed and an uninterrupted run).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Optional, Tuple

import pytest

from . import harness

_REGISTRIES: Dict[type, Any] = {}


class PluginContract:
    """What every plugin category shares: discovery, config ownership, a real engine run,
    checkpoint round-trip and teardown. Category suites below fill in the category."""

    #: the category under test (set by each suite)
    category: str = ""
    #: the name the config selects (set by the subclass)
    plugin_name: str = ""
    #: this plugin's config (see the module docstring)
    section: Any = {}
    #: plugin modules / objects to register at runtime
    plugins: Tuple[Any, ...] = ()
    #: the distribution name runtime-registered plugins are reported under
    distribution: str = "<test>"
    #: more engine config
    extra_config: Dict[str, Any] = {}
    #: optimizer steps per run
    steps: int = 3
    #: a misspelled key to put in the plugin's config (default: derived from its first key)
    typo_key: Optional[str] = None
    #: tolerances when comparing state across a checkpoint (exact by default)
    state_rtol: float = 0.0
    state_atol: float = 0.0

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(autouse=True)
    def _dsplug_contract_setup(self, tmp_path, monkeypatch):
        if not self.plugin_name:
            pytest.fail(f"{type(self).__name__}: set plugin_name to the name the config selects")
        monkeypatch.chdir(tmp_path)
        self.tmp_path = tmp_path
        self._engines: List[Any] = []
        yield
        for engine in self._engines:
            if not getattr(engine, "_dsplug_contract_destroyed", False):
                try:
                    engine.destroy()
                except Exception:  # noqa: BLE001 - teardown of an engine a failed test left behind
                    pass

    # ------------------------------------------------------------------ building blocks
    def registry(self):
        """The registry the tests use: installed plugins plus :attr:`plugins` (one per class)."""
        cls = type(self)
        if cls not in _REGISTRIES:
            _REGISTRIES[cls] = harness.make_registry(*self.plugins, distribution=self.distribution)
        return _REGISTRIES[cls]

    def provided(self):
        """The registry's :class:`dsplug.descriptors.Provided` for this plugin."""
        registry = self.registry()
        found = registry.find(self.category, self.plugin_name)
        if found is None:
            pytest.fail(registry.miss_message(self.category, self.plugin_name)
                        + (" (is its distribution installed, or listed in `plugins`?)"))
        return found

    def plugin_config(self) -> Any:
        """:attr:`section` with ``{tmp_path}`` filled in."""
        tmp = str(getattr(self, "tmp_path", "."))

        def fill(value):
            if isinstance(value, str):
                return value.replace("{tmp_path}", tmp)
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(fill(v) for v in value)
            return value

        return fill(copy.deepcopy(self.section))

    def config_path(self) -> str:
        """The JSON path of this plugin's config."""
        return self.provided().spec.section or ""

    def wrap(self, plugin_config) -> Dict[str, Any]:
        """The engine config holding ``plugin_config`` where this category reads it."""
        return {self.config_path(): plugin_config}

    def engine_config(self, plugin_config: Any = None) -> Dict[str, Any]:
        """The whole engine config of a test run (batch sizes included)."""
        own = self.plugin_config() if plugin_config is None else plugin_config
        return harness.tiny_config(harness.merge(self.extra_config, self.wrap(own)))

    def make_engine(self, **kwargs):
        """A fresh :func:`dsplug.testing.tiny_engine` selecting this plugin."""
        engine = harness.tiny_engine(self.engine_config(), registry=self.registry(), **kwargs)
        self._engines.append(engine)
        return engine

    def parsed_config(self):
        """The :class:`dsplug.config.DsplugConfig` of :meth:`engine_config` (world size 1)."""
        from ..config import DsplugConfig

        return DsplugConfig(self.engine_config(), world_size=1, registry=self.registry())

    def context(self, rank: int = 0, world_size: int = 1, model=None):
        """A :class:`dsplug.context.BuildContext` for calling the factory outside an engine."""
        from .. import comm
        from ..accelerator import get_accelerator
        from ..context import BuildContext

        return BuildContext(config=self.parsed_config(), accelerator=get_accelerator(), comm=comm, rank=rank,
                            world_size=world_size, model=model if model is not None else harness.tiny_model(),
                            registry=self.registry())

    def parsed_section(self, config=None):
        """This plugin's parsed config (an instance of its schema)."""
        config = config or self.parsed_config()
        return config.sections[self.provided().spec.section]

    def build(self, rank: int = 0, world_size: int = 1, plugin_config: Any = None):
        """Call the factory outside an engine, as the engine would (section categories)."""
        if plugin_config is not None:
            from ..config.schema import parse

            section = parse(self.provided().spec.schema, plugin_config, self.config_path())
        else:
            section = self.parsed_section()
        return self.provided().spec.factory(section, self.context(rank, world_size))

    def part(self, engine):
        """The object the engine built for this plugin (None when it builds none)."""
        return engine.events.get_plugin(f"{self.category}:{self.provided().name}")

    def state_of(self, engine) -> Any:
        """The state compared across checkpoints: what the plugin contributes to one."""
        return harness.plugin_state(engine, self.part(engine))

    def trace(self, engine) -> Any:
        """Recorded after every step of the resume test (default: nothing)."""
        return None

    def check_trained(self, engine, losses: List[float]) -> None:
        """More checks after :meth:`test_runs_in_an_engine` trained (override to add some)."""

    def destroy(self, engine) -> None:
        engine.destroy()
        engine._dsplug_contract_destroyed = True

    def _typo(self) -> Optional[Tuple[str, str]]:
        """``(typo, meant)``: a misspelled key for this plugin's config, or None when it takes any key."""
        from ..config.schema import fields_of, key_map

        schema = self.provided().spec.schema
        if schema is None or getattr(schema, "__dsplug_extra_keys__", False):
            return None
        keys = key_map(schema)
        if self.typo_key:
            return self.typo_key, ""
        given = self.plugin_config()
        source = list(given) if isinstance(given, dict) and given else [a.name for a in fields_of(schema)]
        if not source:
            return None
        meant = source[0]
        typo = meant + meant[-1]
        while typo in keys:
            typo += "x"
        return typo, meant

    # ------------------------------------------------------------------ the tests
    def test_spec_is_discoverable(self):
        import attrs

        provided = self.provided()
        spec = provided.spec
        assert spec.category == self.category, f"{spec.name} is registered as {spec.category}, not {self.category}"
        assert spec.schema is None or attrs.has(spec.schema), \
            f"{spec.name}'s schema {spec.schema!r} is not an attrs class (use dsplug.config.schema.schema)"
        if spec.section is not None:
            assert spec.schema is not None, f"{spec.name} owns the section {spec.section!r} but declares no schema"
            owner = self.registry().sections().get(spec.section)
            assert owner is not None and owner.spec is spec, \
                f"the config section {spec.section!r} is owned by {owner and (owner.category, owner.name)}"

    def test_config_check_passes(self):
        from ..config import check_config

        error = check_config(self.engine_config(), world_size=1, registry=self.registry())
        assert error is None, f"the contract's config does not check: {error}"

    def test_typo_in_config_names_its_path(self):
        from ..config import check_config

        typo = self._typo()
        if typo is None:
            pytest.skip("this plugin's schema accepts any key")
        key, meant = typo
        own = self.plugin_config()
        own = dict(own) if isinstance(own, dict) else {}
        if meant in own:
            own[key] = own.pop(meant)
        else:
            own[key] = True
        error = check_config(self.engine_config(own), world_size=1, registry=self.registry())
        assert error is not None, f"a config with the unknown key {key!r} passed the check"
        path = f"{self.config_path()}.{key}"
        paths = [issue.path for issue in error.issues]
        assert path in paths, f"no error names {path!r}; errors: {error}"

    def test_factory_builds_the_contract(self):
        built = self.build()
        if built is None:
            pytest.fail(f"the {self.category} factory of {self.plugin_name} returned None for an enabled config")
        problems = harness.contract_problems(self.category, built)
        assert not problems, "; ".join(problems)
        self.close_standalone(built)

    def close_standalone(self, built) -> None:
        """Release what :meth:`build` made outside an engine (default: its close hook, if any)."""
        closed = getattr(built, "dsplug_engine_closed", None)
        if callable(closed):
            try:
                closed(engine=None)
            except TypeError:
                closed()

    def test_runs_in_an_engine(self):
        engine = self.make_engine()
        losses = harness.train_steps(engine, self.steps)
        assert len(losses) == self.steps and all(math.isfinite(x) for x in losses), f"losses: {losses}"
        assert engine.global_steps == self.steps
        self.check_trained(engine, losses)

    def test_checkpoint_round_trip_and_resume(self):
        """k steps, save, load into a fresh engine: the state is equal; k more steps there end
        where an uninterrupted run of 2k steps ends (state, losses and the trace)."""
        k = max(1, self.steps - 1)
        interrupted = self.make_engine()
        harness.train_steps(interrupted, k)
        saved = self.state_of(interrupted)
        if not harness.has_state(saved):
            pytest.skip(f"{self.plugin_name} keeps no checkpoint state")
        resumed = harness.save_and_load(interrupted, self.tmp_path / "ckpt", self.make_engine)
        harness.assert_state_equal(self.state_of(resumed), saved, f"{self.plugin_name} state after load",
                                   self.state_rtol, self.state_atol)
        whole = self.make_engine()
        trace_whole: List[Any] = []
        losses_whole = harness.train_steps(whole, 2 * k, on_step=lambda e: trace_whole.append(self.trace(e)))
        trace_resumed: List[Any] = []
        losses_resumed = harness.train_steps(resumed, k, on_step=lambda e: trace_resumed.append(self.trace(e)))
        harness.assert_state_equal(losses_resumed, losses_whole[k:], "losses after resuming")
        harness.assert_state_equal(trace_resumed, trace_whole[k:], "trace after resuming")
        harness.assert_state_equal(self.state_of(resumed), self.state_of(whole),
                                   f"{self.plugin_name} state of a resumed run", self.state_rtol, self.state_atol)

    def test_survives_destroy(self):
        engine = self.make_engine()
        harness.train_steps(engine, 1)
        part = self.part(engine)
        self.destroy(engine)
        self.check_destroyed(engine, part)

    def check_destroyed(self, engine, part) -> None:
        """More checks after ``engine.destroy()`` (override to add some)."""


class _TypedContract(PluginContract):
    """Optimizers and schedulers: selected by ``<key>.type``, configured by ``<key>.params``."""

    key = ""

    def config_path(self) -> str:
        return f"{self.key}.params"

    def wrap(self, plugin_config) -> Dict[str, Any]:
        return {self.key: {"type": self.plugin_name, "params": plugin_config}}

    def parsed_section(self, config=None):
        config = config or self.parsed_config()
        return getattr(config, self.key).params

    def build(self, rank: int = 0, world_size: int = 1, plugin_config: Any = None):
        raise NotImplementedError

    def test_spec_is_discoverable(self):
        super().test_spec_is_discoverable()
        spec = self.provided().spec
        assert spec.section is None, f"a {self.category} is configured by {self.key}.params and owns no section"


class OptimizerContract(_TypedContract):
    """An ``optimizer`` plugin (``optimizer.type``): a torch optimizer that changes parameters
    when stepped, whose ``state_dict`` round-trips exactly, and that trains inside an engine.

    Override :meth:`reference_optimizer` to compare three steps with a reference implementation.
    """

    category = "optimizer"
    key = "optimizer"
    #: tolerances against the reference optimizer
    reference_rtol: float = 1e-5
    reference_atol: float = 1e-6

    def reference_optimizer(self, params):
        """A reference optimizer over ``params`` expected to step identically (or None)."""
        return None

    def build(self, rank: int = 0, world_size: int = 1, plugin_config: Any = None, params=None):
        params = params if params is not None else list(harness.tiny_model().parameters())
        return self.provided().spec.factory([{"params": params}], self.parsed_section(), self.context(rank, world_size))

    def part(self, engine):
        return engine.basic_optimizer

    def state_of(self, engine):
        return {"optimizer": engine.basic_optimizer.state_dict(),
                "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}}

    def trace(self, engine):
        return [g["lr"] for g in engine.basic_optimizer.param_groups]

    @staticmethod
    def _grads(step: int, params):
        import torch

        g = torch.Generator().manual_seed(100 + step)
        return [torch.randn(p.shape, generator=g) for p in params]

    def _step(self, optimizer, params, step: int) -> None:
        for p, grad in zip(params, self._grads(step, params)):
            p.grad = grad.to(p.dtype)
        optimizer.step()
        optimizer.zero_grad()

    def test_step_changes_parameters(self):
        params = list(harness.tiny_model().parameters())
        before = [p.detach().clone() for p in params]
        optimizer = self.build(params=params)
        self._step(optimizer, params, 0)
        assert any(not (a == b.detach()).all() for a, b in zip(before, params)), "optimizer.step() changed nothing"
        assert all(p.grad is None or not p.grad.any() for p in params), "zero_grad() left gradients behind"

    def test_state_dict_round_trips(self):
        import torch

        params = list(harness.tiny_model().parameters())
        optimizer = self.build(params=params)
        for step in range(2):
            self._step(optimizer, params, step)
        twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
        other = self.build(params=twin)
        other.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        harness.assert_state_equal(other.state_dict(), optimizer.state_dict(), "loaded state_dict")
        self._step(optimizer, params, 2)
        self._step(other, twin, 2)
        harness.assert_state_equal([p.detach() for p in twin], [p.detach() for p in params],
                                   "parameters after a step from loaded state")

    def test_matches_reference(self):
        import torch

        model = harness.tiny_model()
        params = list(model.parameters())
        twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
        reference = self.reference_optimizer(twin)
        if reference is None:
            pytest.skip("no reference_optimizer given")
        optimizer = self.build(params=params)
        for step in range(3):
            self._step(optimizer, params, step)
            self._step(reference, twin, step)
        harness.assert_state_equal([p.detach() for p in params], [p.detach() for p in twin],
                                   "parameters against the reference", self.reference_rtol, self.reference_atol)

    def check_trained(self, engine, losses):
        initial = harness.tiny_model()
        changed = [not (a.detach().cpu() == b.detach()).all()
                   for a, b in zip(engine.module.parameters(), initial.parameters())]
        assert any(changed), "training in an engine left every parameter unchanged"


class SchedulerContract(_TypedContract):
    """A ``scheduler`` plugin (``scheduler.type``): an LR scheduler that changes the lr over
    :attr:`steps` steps, and whose state round-trips so a resumed run continues the schedule
    exactly (the lr of every step after the resume equals the uninterrupted run's)."""

    category = "scheduler"
    key = "scheduler"
    #: set False for a schedule that may stay constant over the first steps
    lr_must_change: bool = True

    def build(self, rank: int = 0, world_size: int = 1, plugin_config: Any = None, optimizer=None):
        import torch

        if optimizer is None:
            optimizer = torch.optim.SGD(harness.tiny_model().parameters(), lr=harness.DEFAULT_LR)
        return self.provided().spec.factory(optimizer, self.parsed_section(), self.context(rank, world_size))

    def part(self, engine):
        return engine.lr_scheduler

    def state_of(self, engine):
        return {"scheduler": engine.lr_scheduler.state_dict(), "lr": list(engine.get_lr())}

    def trace(self, engine):
        return list(engine.get_lr())

    def test_get_last_lr_lists_every_group(self):
        import torch

        model = harness.tiny_model()
        optimizer = torch.optim.SGD([{"params": [model[0].weight]}, {"params": [model[2].weight]}],
                                    lr=harness.DEFAULT_LR)
        scheduler = self.build(optimizer=optimizer)
        optimizer.step()  # no gradients: changes nothing, but keeps torch's order check quiet
        scheduler.step()
        last = scheduler.get_last_lr()
        assert len(last) == 2 and all(isinstance(float(x), float) for x in last), f"get_last_lr() = {last!r}"
        assert [float(x) for x in last] == [g["lr"] for g in optimizer.param_groups], \
            "get_last_lr() differs from the lr set on the optimizer's groups"

    def test_lr_changes(self):
        if not self.lr_must_change:
            pytest.skip("lr_must_change is False")
        engine = self.make_engine()
        lrs = [list(engine.get_lr())]
        harness.train_steps(engine, self.steps, on_step=lambda e: lrs.append(list(e.get_lr())))
        assert any(lr != lrs[0] for lr in lrs[1:]), f"the lr never changed over {self.steps} steps: {lrs}"


class _SectionContract(PluginContract):
    """Plugins built from a section they own: ``factory(section, context)``."""

    def test_spec_is_discoverable(self):
        super().test_spec_is_discoverable()
        spec = self.provided().spec
        assert spec.section, f"a {self.category} plugin owns a config section (set PluginSpec.section)"


class MonitorContract(_SectionContract):
    """A ``monitor`` plugin: owns its section; when enabled, the engine joins the object its
    factory returns to the event bus and, after every optimizer step, its ``write_events``
    receives DeepSpeed's tags (``Train/Samples/train_loss``, ``Train/Samples/lr``) keyed by
    ``global_samples``. Disabled, or on a rank other than 0, the factory builds nothing (or a
    monitor with ``enabled = False``).

    Override :meth:`read_back` to read what the monitor wrote after the engine closed it.
    """

    category = "monitor"
    section = {"enabled": True}

    def read_back(self, tmp_path) -> Optional[List[Tuple[str, float, int]]]:
        """The ``(tag, value, step)`` events the monitor wrote under ``tmp_path`` (None: skip)."""
        return None

    def spy(self, monitor) -> List[Tuple[str, float, int]]:
        """Record every event handed to ``monitor.write_events`` from now on."""
        seen: List[Tuple[str, float, int]] = []
        original = monitor.write_events

        def write_events(events):
            events = list(events)
            seen.extend((str(t), float(v), int(s)) for t, v, s in events)
            return original(events)

        monitor.write_events = write_events
        return seen

    def _train_and_spy(self):
        engine = self.make_engine()
        monitor = self.part(engine)
        assert monitor is not None, f"the engine built no {self.plugin_name} monitor for an enabled section"
        seen = self.spy(monitor)
        lrs: List[float] = []
        losses = harness.train_steps(engine, self.steps, on_step=lambda e: lrs.append(e.get_lr()[0]))
        return engine, monitor, seen, losses, lrs

    def test_write_events_receives_deepspeed_tags(self):
        engine, _, seen, losses, lrs = self._train_and_spy()
        samples = [engine.train_batch_size() * (i + 1) for i in range(self.steps)]
        for tag, want in (("Train/Samples/train_loss", losses), ("Train/Samples/lr", lrs)):
            got = [(s, v) for t, v, s in seen if t == tag]
            assert [s for s, _ in got] == samples, f"{tag} was written at steps {[s for s, _ in got]}, " \
                                                   f"expected global_samples {samples}"
            for (_, value), expected in zip(got, want):
                assert math.isclose(value, expected, rel_tol=1e-6, abs_tol=1e-9), f"{tag}: {value} != {expected}"

    def test_written_events_read_back(self):
        engine, _, seen, _, _ = self._train_and_spy()
        self.destroy(engine)
        written = self.read_back(self.tmp_path)
        if written is None:
            pytest.skip("no read_back given")
        written = [(str(t), float(v), int(s)) for t, v, s in written]
        missing = [e for e in seen if e not in written]
        assert not missing, f"events handed to write_events but not found by read_back: {missing[:5]}"

    def test_disabled_builds_nothing(self):
        from ..config.schema import key_map

        if "enabled" not in key_map(self.provided().spec.schema):
            pytest.skip("the section has no 'enabled' key")
        own = self.plugin_config()
        built = self.build(plugin_config={**own, "enabled": False})
        assert built is None or getattr(built, "enabled", True) is False, \
            f"enabled: false built an enabled {type(built).__name__}"

    def test_only_rank_zero_writes(self):
        built = self.build(rank=1, world_size=2)
        assert built is None or getattr(built, "enabled", True) is False, \
            f"rank 1 of 2 built an enabled {type(built).__name__}; only rank 0 writes"


class ObserverContract(_SectionContract):
    """An ``observer`` plugin: owns its section; when enabled, the engine joins the object its
    factory returns to its event bus for the engine's lifetime. Override :meth:`check_trained`
    to check what it observed."""

    category = "observer"
    section = {"enabled": True}

    def test_joins_the_event_bus(self):
        engine = self.make_engine()
        observer = self.part(engine)
        assert observer is not None, f"the engine built no {self.plugin_name} observer for its section"
        hooks = {c.name for c in engine.events.get_hookcallers(observer) or []}
        assert hooks == set(harness.lifecycle_hooks_of(observer)) and hooks, \
            f"the observer is on the bus for {sorted(hooks)}"


class PrecisionContract(_SectionContract):
    """A ``precision`` plugin: owns its section; ``enabled: true`` selects it, the engine casts
    the model to ``model_dtype``, wraps forwards in ``autocast()``, scales losses and saves
    ``state_dict()`` in every rank's checkpoint file under ``"precision"``."""

    category = "precision"
    section = {"enabled": True}

    def part(self, engine):
        return engine.precision

    def test_is_selected_by_its_section(self):
        engine = self.make_engine()
        standalone = self.build()
        assert type(engine.precision) is type(standalone) and engine.precision.name == standalone.name, \
            f"the engine selected {engine.precision!r}, not {self.plugin_name}"
        dtype = engine.precision.model_dtype
        if dtype is not None:
            assert all(p.dtype == dtype for p in engine.module.parameters()), f"the model is not in {dtype}"


class CompressionContract(_SectionContract):
    """A ``compression`` plugin (a key under ``compression_training``): ``compress`` keeps the
    model callable (same output shape), ``on_step`` runs once per applied optimizer step with
    the new ``global_steps``, ``clean`` returns a callable model, and ``state_dict`` round-trips
    through checkpoints under ``compression.<name>``."""

    category = "compression"

    def config_path(self) -> str:
        return f"compression_training.{self.provided().name}"

    def wrap(self, plugin_config) -> Dict[str, Any]:
        return {"compression_training": {self.provided().name: plugin_config}}

    def parsed_section(self, config=None):
        config = config or self.parsed_config()
        for provided, section in config.compression:
            if provided.spec is self.provided().spec:
                return section
        raise AssertionError(f"compression_training has no {self.plugin_name} entry")

    def build(self, rank: int = 0, world_size: int = 1, plugin_config: Any = None):
        method = super().build(rank, world_size, plugin_config)
        if method is not None:
            method.name = self.provided().name
        return method

    def part(self, engine):
        name = self.provided().name
        return next((m for m in engine.compression if m.name == name), None)

    def model(self):
        """The model the tests compress (override for a method that needs other layers, e.g.
        Conv2d); it takes :func:`dsplug.testing.tiny_batch` inputs. Default: ``tiny_model()``."""
        return harness.tiny_model()

    def make_engine(self, **kwargs):
        kwargs.setdefault("model", self.model())
        return super().make_engine(**kwargs)

    def test_spec_is_discoverable(self):
        PluginContract.test_spec_is_discoverable(self)
        spec = self.provided().spec
        assert spec.schema is not None, f"{spec.name} declares no schema for its compression_training entry"

    def test_compress_keeps_the_model_callable(self):
        import torch

        reference = self.model()
        x, _ = harness.tiny_batch(0, size=3)
        with torch.no_grad():
            want = reference(x)
        method = self.build()
        model = method.compress(self.model())
        assert isinstance(model, torch.nn.Module), f"compress returned {type(model).__name__}, not a module"
        with torch.no_grad():
            got = model(x)
        assert got.shape == want.shape and torch.isfinite(got).all(), f"compressed model output {got!r}"
        cleaned = method.clean(model)
        with torch.no_grad():
            assert cleaned(x).shape == want.shape, "clean(model) changed the output shape"

    def test_on_step_runs_per_applied_step(self):
        engine = self.make_engine()
        method = self.part(engine)
        assert method is not None, f"the engine built no {self.plugin_name} method"
        calls: List[int] = []
        original = method.on_step

        def on_step(global_steps):
            calls.append(int(global_steps))
            return original(global_steps)

        method.on_step = on_step
        harness.train_steps(engine, self.steps)
        assert calls == list(range(1, self.steps + 1)), f"on_step got {calls}"
        state = method.state_dict()
        assert isinstance(state, dict), f"state_dict() returned {type(state).__name__}"


class SectionContract(_SectionContract):
    """A section-only plugin (``dsplug_config_sections``): owns a config section without being a
    selectable feature. Only discovery, config ownership and an engine run with the section
    present are checked."""

    category = "section"

    def test_factory_builds_the_contract(self):
        pytest.skip("a section-only plugin builds nothing")

    def part(self, engine):
        return None
