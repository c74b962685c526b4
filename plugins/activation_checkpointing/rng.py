"""Named RNG states for model-parallel dropout (Megatron-LM's ``CudaRNGStatesTracker``).

Device-agnostic through :func:`dsplug.accelerator.get_accelerator`: each tracked state is the
accelerator's generator state (``get_accelerator().get_rng_state()``: a CUDA device's generator,
torch's CPU generator on the CPU accelerator). ``fork(name)`` runs its body with that state and
stores the advanced state back, so the ops inside draw from a stream of their own.
"""
from __future__ import annotations

import contextlib
import copy

import torch

from dsplug.accelerator import get_accelerator

#: DeepSpeed / Megatron's name of the model-parallel state
_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _device_rng_state():
    return get_accelerator().get_rng_state()


def _set_device_rng_state(state) -> None:
    get_accelerator().set_rng_state(state)


def _device_is_host() -> bool:
    return get_accelerator().device_name() == "cpu"


class CudaRNGStatesTracker:
    """Tracker of named accelerator RNG states (the name is DeepSpeed's; any accelerator works).

    ``add(name, seed)`` creates a state seeded with ``seed``; ``fork(name)`` is a context manager
    running its body on that state; ``get_states`` / ``set_states`` copy the table (the
    activation checkpoint saves it at forward and restores it for the recompute); ``reset``
    empties it.
    """

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        """A shallow copy of ``{name: state}`` (states are replaced, never mutated, so it is a snapshot)."""
        return copy.copy(self.states_)

    def set_states(self, states) -> None:
        """Replace the table by ``states`` (from :meth:`get_states`)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; the current generator state is untouched."""
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        accelerator = get_accelerator()
        # an accelerator's manual_seed may seed torch's CPU generator too: keep both
        cpu_state = torch.get_rng_state()
        device_state = None if _device_is_host() else _device_rng_state()
        try:
            accelerator.manual_seed(seed)
            self.states_[name] = _device_rng_state()
        finally:
            torch.set_rng_state(cpu_state)
            if device_state is not None:
                _set_device_rng_state(device_state)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the body on the state ``name``; afterwards store its advanced state and put the
        generator back where it was."""
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        original = _device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _device_rng_state()
            _set_device_rng_state(original)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker (the one the activation checkpoint saves and restores)."""
    return _CUDA_RNG_STATE_TRACKER
