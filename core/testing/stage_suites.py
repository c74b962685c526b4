"""Contract suites for the categories the engine drives below the optimizer: ZeRO stages,
offload devices and accelerators (pytest base classes, like those of :mod:`.suites`).

::

    from dsplug.testing import OffloadDeviceContract

    class TestMmapDevice(OffloadDeviceContract):
        plugin_name = "mmap"
        section = {"nvme_path": "{tmp_path}"}

What each suite checks is in its docstring; every check runs the plugin as the engine would.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional

import pytest

from . import harness
from .suites import PluginContract

#: the optimizer section of the engine runs (offload steps the host share with the CPU optimizer)
ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}


def _files_under(root) -> List[str]:
    out = []
    for folder, _dirs, files in os.walk(root):
        out += [os.path.join(folder, f) for f in files]
    return sorted(out)


def _gathered(engine) -> Dict[str, Any]:
    """The full module weights (a collective for partitioned stages: every rank calls it)."""
    return {k: v.detach().float().cpu().clone() for k, v in engine.stage.module_state_dict().items()}


# ============================================================================== ZeRO stages
class ZeroStageContract(PluginContract):
    """A ``zero_stage`` plugin (``zero_optimization.stage`` names it): declares its traits
    (:class:`dsplug.contracts.ZeroStageTraits`) identically in its spec and on the built stage,
    trains the tiny model like a plain PyTorch loop (SGD, the harness's data), gives the full
    module state dict, answers ``engine.zero_optimization_stage()`` from its traits, resumes
    from a checkpoint exactly, and is what an unknown stage name's error lists.

    ``section``: more ``zero_optimization`` keys for the runs (``stage`` is set from
    :attr:`plugin_name`). ``reference_rtol`` / ``reference_atol``: tolerance against the plain loop.
    """

    category = "zero_stage"
    section: Dict[str, Any] = {}
    reference_rtol: float = 1e-5
    reference_atol: float = 1e-6

    def config_path(self) -> str:
        return "zero_optimization"

    def stage_value(self):
        """What the config writes for this stage: DeepSpeed's number for "0".."3", else the name."""
        return int(self.plugin_name) if self.plugin_name.isdigit() else self.plugin_name

    def wrap(self, plugin_config) -> Dict[str, Any]:
        return {"zero_optimization": {"stage": self.stage_value(), **(plugin_config or {})}}

    def part(self, engine):
        return engine.stage

    def state_of(self, engine):
        return {"module": _gathered(engine), "stage": engine.stage.state_dict()}

    def test_spec_is_discoverable(self):
        super().test_spec_is_discoverable()
        from ..contracts.zero_stage import ZeroStageTraits

        traits = self.provided().spec.traits
        assert isinstance(traits, ZeroStageTraits), \
            f"stage {self.plugin_name!r} declares no PluginSpec.traits (a dsplug.contracts.ZeroStageTraits), so " \
            "config checks cannot tell what it partitions or offloads"

    def test_typo_in_config_names_its_path(self):
        from ..config import check_config

        config = self.engine_config({**self.plugin_config(), "reduce_bucket_sise": 10})
        error = check_config(config, world_size=1, registry=self.registry())
        assert error is not None and "zero_optimization.reduce_bucket_sise" in [i.path for i in error.issues], \
            f"a typo in zero_optimization was not reported at its path: {error}"

    def test_own_keys_of_zero_optimization_only_while_selected(self):
        """A stage whose spec has a ``schema`` (its keys of ``zero_optimization``): the config
        selecting it parses them (defaults filled in); with stage 0 selected each is an error
        naming this stage."""
        from ..config import check_config
        from ..config.schema import fields_of

        schema_cls = self.provided().spec.schema
        if schema_cls is None:
            import pytest

            pytest.skip(f"stage {self.plugin_name!r} adds no keys to zero_optimization (its spec has no schema)")
        params = self.parsed_config().selected_params("zero_stage")
        assert isinstance(params, schema_cls), \
            f"config.selected_params('zero_stage') is {params!r}, not an instance of the spec's schema {schema_cls}"
        for key in [a.name for a in fields_of(schema_cls)]:
            config = harness.tiny_config({"zero_optimization": {"stage": 0, key: getattr(params, key)}})
            error = check_config(config, world_size=1, registry=self.registry())
            assert error is not None and f"zero_optimization.{key}" in [i.path for i in error.issues] \
                and repr(self.plugin_name) in str(error), \
                f"zero_optimization.{key} (a key of stage {self.plugin_name!r}) was not refused at stage 0: {error}"

    def test_factory_builds_the_contract(self):
        engine = self.make_engine()
        problems = harness.contract_problems(self.category, engine.stage)
        assert not problems, "; ".join(problems)

    def test_traits_of_the_built_stage_are_the_declared_ones(self):
        engine = self.make_engine()
        declared = self.provided().spec.traits
        assert engine.stage.traits == declared, \
            f"the built stage's traits {engine.stage.traits} differ from its spec's {declared}"
        number = engine.zero_optimization_stage()
        assert number == declared.zero_optimization_stage() and number in (0, 1, 2, 3), \
            f"engine.zero_optimization_stage() = {number!r}"

    def test_trains_like_a_plain_pytorch_loop(self):
        import torch

        engine = self.make_engine()
        losses = harness.train_steps(engine, self.steps)
        model = harness.tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=harness.DEFAULT_LR)
        want = []
        for step in range(self.steps):
            x, y = harness.tiny_batch(step, 0, engine.train_micro_batch_size_per_gpu())
            loss = harness.tiny_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            want.append(float(loss.detach()))
        harness.assert_state_equal(losses, want, "losses against plain PyTorch SGD", self.reference_rtol,
                                   self.reference_atol)
        got = _gathered(engine)
        harness.assert_state_equal({k: got[k] for k in model.state_dict()},
                                   {k: v.detach() for k, v in model.state_dict().items()},
                                   "weights against plain PyTorch SGD", self.reference_rtol, self.reference_atol)

    def test_module_state_dict_is_the_full_model(self):
        engine = self.make_engine()
        harness.train_steps(engine, 1)
        state = engine.stage.module_state_dict()
        want = harness.tiny_model().state_dict()
        assert set(state) == set(want), f"module_state_dict() keys {sorted(state)} != the model's {sorted(want)}"
        for key, value in want.items():
            assert tuple(state[key].shape) == tuple(value.shape), \
                f"module_state_dict()[{key!r}] has shape {tuple(state[key].shape)}, the model {tuple(value.shape)}"

    def test_an_unknown_stage_lists_the_installed_ones(self):
        from ..config import check_config

        error = check_config(harness.tiny_config({"zero_optimization": {"stage": "no-such-stage"}}), world_size=1,
                             registry=self.registry())
        assert error is not None, "an unknown zero_optimization.stage passed the config check"
        message = str(error)
        assert "zero_optimization.stage" in message and "Installed zero_stage plugins" in message \
            and self.plugin_name in message, message

    def check_destroyed(self, engine, part) -> None:
        assert engine.stage is part


# ============================================================================== offload devices
class OffloadDeviceContract(PluginContract):
    """An ``offload_device`` plugin (``zero_optimization.offload_*.device`` names it): storage.

    Its capabilities are among the kernel's (``byte_addressable`` / ``needs_swap_buffers``) and
    the same before and after building it; building it leaves no trace; tensors of several dtypes
    and sizes read back exactly as written (on separate write streams too), in place when
    byte-addressable; a freed name can be allocated again; ``close`` (and ``engine.destroy()``)
    removes its files; ZeRO stage 3 offloading parameters and optimizer to it (and stage 2 the
    optimizer, when byte-addressable) trains like :attr:`compare_with` (exactly by default) and
    resumes from a checkpoint exactly.

    ``section``: the offload section's keys besides ``device`` (``nvme_path``, ``pin_memory``),
    for both sections; ``param_extra`` / ``optimizer_extra``: keys only ``offload_param`` /
    ``offload_optimizer`` take; ``zero_extra``: more ``zero_optimization`` keys.
    """

    category = "offload_device"
    section: Dict[str, Any] = {}
    param_extra: Dict[str, Any] = {}
    optimizer_extra: Dict[str, Any] = {}
    zero_extra: Dict[str, Any] = {}
    extra_config: Dict[str, Any] = {"optimizer": ADAMW}
    #: the device whose training trajectory this one must reproduce, and how closely
    compare_with: str = "cpu"
    compare_rtol: float = 0.0
    compare_atol: float = 0.0

    # ------------------------------------------------------------------ config
    def config_path(self) -> str:
        return "zero_optimization.offload_optimizer"

    def offload_section(self, key: str, device: Optional[str] = None, plugin_config=None) -> Dict[str, Any]:
        own = self.plugin_config() if plugin_config is None else plugin_config
        extra = self.param_extra if key == "offload_param" else self.optimizer_extra
        return {"device": device or self.plugin_name, **own, **extra}

    def zero_config(self, stage: int = 3, device: Optional[str] = None, plugin_config=None) -> Dict[str, Any]:
        zero = {"stage": stage, **self.zero_extra,
                "offload_optimizer": self.offload_section("offload_optimizer", device, plugin_config)}
        if stage == 3:
            zero["offload_param"] = self.offload_section("offload_param", device, plugin_config)
        return zero

    def wrap(self, plugin_config) -> Dict[str, Any]:
        return {"zero_optimization": self.zero_config(plugin_config=plugin_config)}

    def parsed_section(self, config=None, key: str = "offload_optimizer"):
        config = config or self.parsed_config()
        return getattr(config.sections["zero_optimization"], key)

    def build(self, rank: int = 0, world_size: int = 1, plugin_config: Any = None, key: str = "offload_optimizer"):
        device = self.provided().spec.factory(self.parsed_section(key=key), self.context(rank, world_size))
        device.config_path = f"zero_optimization.{key}"
        return device

    def capabilities(self):
        built = self.build()
        try:
            return frozenset(built.capabilities)
        finally:
            built.close()

    def state_of(self, engine):
        return {"module": _gathered(engine), "stage": engine.stage.state_dict()}

    def part(self, engine):
        return None

    # ------------------------------------------------------------------ the tests
    def test_spec_is_discoverable(self):
        provided = self.provided()
        assert provided.spec.category == self.category
        if provided.spec.section is not None:
            owner = self.registry().sections().get(provided.spec.section)
            assert owner is not None and owner.spec is provided.spec

    def test_typo_in_config_names_its_path(self):
        from ..config import check_config

        own = {**self.plugin_config(), "pin_memoryy": True}
        error = check_config(self.engine_config(own), world_size=1, registry=self.registry())
        assert error is not None and "zero_optimization.offload_optimizer.pin_memoryy" in [i.path for i in error.issues], \
            f"a typo in the offload section was not reported at its path: {error}"

    def close_standalone(self, built) -> None:
        built.close()

    def test_declares_known_capabilities(self):
        from ..contracts.offload import BYTE_ADDRESSABLE, CAPABILITIES, NEEDS_SWAP_BUFFERS, capabilities_of

        capabilities = self.capabilities()
        unknown = sorted(capabilities - set(CAPABILITIES))
        assert not unknown, f"unknown capabilities {unknown}; the kernel's are {sorted(CAPABILITIES)}"
        assert capabilities & {BYTE_ADDRESSABLE, NEEDS_SWAP_BUFFERS}, \
            f"{self.plugin_name} declares neither {BYTE_ADDRESSABLE!r} nor {NEEDS_SWAP_BUFFERS!r}: no stage can use it"
        declared = capabilities_of(self.provided())
        assert declared is None or declared == capabilities, \
            f"config checks see capabilities {sorted(declared)}, the built device has {sorted(capabilities)}"

    def test_building_leaves_no_trace(self):
        before = _files_under(self.tmp_path)
        device = self.build()
        assert _files_under(self.tmp_path) == before, "building the device created files (do it in reserve/allocate)"
        device.close()

    def _round_trip(self, device, name: str, numel: int, dtype, stream: int = 0):
        import torch

        g = torch.Generator().manual_seed(numel)
        want = (torch.randn(numel, generator=g) * 100).to(dtype)
        stored = device.allocate(name, numel, dtype)
        source = device.swap_buffer(numel, dtype)[:numel]
        source.copy_(want)
        return stored, want, source, device.write(stored, source, stream)

    def test_tensors_read_back_as_written(self):
        import torch

        device = self.build()
        try:
            cases = [("a", 1, torch.float32), ("b", 1000, torch.float32), ("c", 4097, torch.bfloat16),
                     ("d", 3000, torch.uint8), ("e", 777, torch.float16)]
            device.reserve(sum(n * dt.itemsize for _, n, dt in cases))
            written = [self._round_trip(device, *case) for case in cases]
            for _, _, _, work in written:
                work.wait()
                work.wait()  # twice is harmless
            for (stored, want, _, _), (_, numel, dtype) in zip(written, cases):
                assert (stored.numel, stored.dtype) == (numel, dtype), f"{stored!r} for {numel} x {dtype}"
                target = device.swap_buffer(numel, dtype)[:numel]
                target.zero_()
                device.prefetch(stored)
                device.read(stored, target).wait()
                assert torch.equal(target, want), f"{stored.name}: read back differs from what was written"
        finally:
            device.close()

    def test_write_streams_complete_independently(self):
        import torch

        device = self.build()
        try:
            first = self._round_trip(device, "s0", 5000, torch.float32, stream=0)
            second = self._round_trip(device, "s1", 5000, torch.float32, stream=1)
            second[3].wait()
            first[3].wait()
            for stored, want, _, _ in (first, second):
                target = torch.empty(stored.numel, dtype=stored.dtype)
                device.read(stored, target).wait()
                assert torch.equal(target, want), f"{stored.name}: stream write lost"
        finally:
            device.close()

    def test_byte_addressable_tensor_is_the_data(self):
        import torch

        from ..contracts.offload import BYTE_ADDRESSABLE

        device = self.build()
        try:
            if BYTE_ADDRESSABLE not in device.capabilities:
                pytest.skip(f"{self.plugin_name} is not byte-addressable")
            stored, want, _, work = self._round_trip(device, "t", 2048, torch.float32)
            work.wait()
            tensor = device.tensor(stored)
            assert tensor.numel() == 2048 and tensor.dtype == torch.float32 and torch.equal(tensor, want)
            tensor.mul_(2)  # an in-place update is an update of the stored data
            target = torch.empty(2048)
            device.read(stored, target).wait()
            assert torch.equal(target, want * 2), "an in-place write of tensor(stored) did not reach the stored data"
        finally:
            device.close()

    def test_free_then_allocate_again(self):
        import torch

        device = self.build()
        try:
            stored, _, _, work = self._round_trip(device, "again", 300, torch.float32)
            work.wait()
            device.free(stored)
            stored, want, _, work = self._round_trip(device, "again", 500, torch.float32)
            work.wait()
            target = torch.empty(500)
            device.read(stored, target).wait()
            assert torch.equal(target, want)
        finally:
            device.close()

    def test_close_removes_its_files(self):
        import torch

        device = self.build()
        stored, _, _, work = self._round_trip(device, "kept", 1000, torch.float32)
        work.wait()
        where = device.location(stored)
        device.close()
        if where is not None:
            assert not os.path.exists(where), f"{where} is still there after close()"
        leftover = [f for f in _files_under(self.tmp_path) if "ckpt" not in f]
        assert leftover == [], f"close() left files behind: {leftover[:5]}"

    def _run(self, stage: int, device: Optional[str] = None):
        config = harness.merge(self.extra_config, {"zero_optimization": self.zero_config(stage, device)})
        engine = harness.tiny_engine(config, registry=self.registry())
        self._engines.append(engine)
        losses = harness.train_steps(engine, self.steps)
        return losses, _gathered(engine), engine

    def _trains_like(self, stage: int) -> None:
        if self.compare_with == self.plugin_name:
            pytest.skip(f"{self.plugin_name} is the device the others are compared with")
        got_losses, got_weights, engine = self._run(stage)
        self.destroy(engine)
        want_losses, want_weights, other = self._run(stage, self.compare_with)
        self.destroy(other)
        where = f"stage {stage}, {self.plugin_name} against {self.compare_with}"
        harness.assert_state_equal(got_losses, want_losses, f"losses ({where})", self.compare_rtol, self.compare_atol)
        harness.assert_state_equal(got_weights, want_weights, f"weights ({where})", self.compare_rtol,
                                   self.compare_atol)

    def test_stage3_trains_like_the_reference_device(self):
        self._trains_like(3)

    def test_stage2_optimizer_offload(self):
        """Byte-addressable: stage 2 offloads the optimizer to it and trains like the reference
        device. Otherwise: the config check refuses stage 2, naming the device."""
        from ..config import check_config
        from ..contracts.offload import BYTE_ADDRESSABLE

        if BYTE_ADDRESSABLE in self.capabilities():
            self._trains_like(2)
            return
        config = harness.merge(self.extra_config, {"zero_optimization": self.zero_config(2)})
        error = check_config(harness.tiny_config(config), world_size=1, registry=self.registry())
        assert error is not None and repr(self.plugin_name) in str(error), \
            f"stage 2 with a device that is not byte-addressable passed the config check: {error}"

    def test_trained_losses_are_finite(self):
        losses, _, _ = self._run(3)
        assert all(math.isfinite(x) for x in losses), losses

    def check_destroyed(self, engine, part) -> None:
        leftover = [f for f in _files_under(self.tmp_path) if "ckpt" not in f]
        assert leftover == [], f"engine.destroy() left the device's files behind: {leftover[:5]}"


# ============================================================================== accelerators
class AcceleratorContract(PluginContract):
    """An ``accelerator`` plugin (picked by priority, or by ``DSPLUG_ACCELERATOR``): a
    :class:`dsplug.contracts.Accelerator` that answers device questions consistently, moves
    tensors to its device and back, reproduces random draws from a saved RNG state, pins host
    tensors (or returns them unchanged), and trains the tiny model when selected. Skipped where
    ``is_available()`` is False (a CUDA plugin on a CPU-only machine)."""

    category = "accelerator"

    @pytest.fixture(autouse=True)
    def _dsplug_accelerator_selected(self, monkeypatch, _dsplug_contract_setup):
        accelerator = self.provided().spec.factory()
        if not accelerator.is_available():
            pytest.skip(f"accelerator {self.plugin_name!r} is not available here")
        monkeypatch.setenv("DSPLUG_ACCELERATOR", self.provided().name)
        from ..accelerator import get_accelerator, set_accelerator

        previous = get_accelerator()
        yield
        set_accelerator(previous)

    def config_path(self) -> str:
        return ""

    def wrap(self, plugin_config) -> Dict[str, Any]:
        return {}

    def build(self, rank: int = 0, world_size: int = 1, plugin_config: Any = None):
        return self.provided().spec.factory()

    def part(self, engine):
        return None

    def test_spec_is_discoverable(self):
        spec = self.provided().spec
        assert spec.category == "accelerator" and spec.section is None and callable(spec.factory)

    def test_typo_in_config_names_its_path(self):
        pytest.skip("an accelerator has no config section")

    def test_answers_device_questions(self):
        import torch

        accelerator = self.build()
        backend = accelerator.communication_backend_name()
        assert isinstance(backend, str) and backend, f"communication_backend_name() = {backend!r}"
        assert accelerator.device_count() >= 1
        device = accelerator.training_device(0)
        assert isinstance(device, torch.device), f"training_device(0) = {device!r}"
        assert isinstance(accelerator.device_name(), str)

    def test_moves_tensors_to_its_device_and_back(self):
        import torch

        accelerator = self.build()
        host = torch.arange(12, dtype=torch.float32)
        on_device = host.to(accelerator.training_device(0))
        accelerator.synchronize()
        assert torch.equal(on_device.cpu(), host)

    def test_rng_state_reproduces_draws(self):
        import torch

        accelerator = self.build()
        accelerator.manual_seed(1234)
        state = accelerator.rng_state()
        cpu_state = torch.get_rng_state()
        device = accelerator.training_device(0)
        first = torch.rand(5, device=device).cpu()
        accelerator.set_rng_state(state)
        torch.set_rng_state(cpu_state)
        again = torch.rand(5, device=device).cpu()
        assert torch.equal(first, again), "set_rng_state(rng_state()) did not reproduce the draws"

    def test_pin_memory_keeps_the_values(self):
        import torch

        accelerator = self.build()
        host = torch.arange(8, dtype=torch.float32)
        pinned = accelerator.pin_memory(host)
        assert torch.equal(pinned, host) and pinned.device.type == "cpu"

    def test_engine_runs_on_it(self):
        engine = self.make_engine()
        harness.train_steps(engine, 1)
        want = self.build().training_device(engine.local_rank)
        assert engine.device.type == want.type, f"the engine trains on {engine.device}, not {want}"
