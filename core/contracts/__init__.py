"""What the engine drives: one small base class (or Protocol) per plugin category.

A plugin's factory returns an object of its category's contract. The docstrings of these classes
are the plugin author's manual: what the engine calls, when, with what, and what it expects back.
``docs/writing-plugins.md`` walks through each with an example, and :mod:`dsplug.testing` holds
the contract test suites a plugin runs against itself.

=================  =====================================  ======================================
category           factory returns                        engine calls
=================  =====================================  ======================================
accelerator        :class:`Accelerator`                   device questions, streams, RNG
optimizer          a ``torch.optim.Optimizer``            via the ZeRO stage (:class:`Optimizer`)
scheduler          :class:`LRScheduler`                   ``step()`` per applied step
precision          :class:`Precision`                     loss scaling, autocast, overflow
zero_stage         :class:`ZeroStage`                     backward hooks, ``step()``, state
offload_device     :class:`OffloadDevice`                 (the ZeRO stage does) allocate, read, write
monitor            :class:`Monitor`                       ``write_events`` per step
observer           :class:`Observer`                      lifecycle hooks
compression        :class:`CompressionMethod`             ``compress(model)``, per-step schedule
=================  =====================================  ======================================
"""
from __future__ import annotations

from ..accelerator import Accelerator
from .checkpoint import CheckpointView, LoadOptions, SaveOptions
from .compression import CompressionMethod
from .observer import Monitor, Observer
from .offload import BYTE_ADDRESSABLE, NEEDS_SWAP_BUFFERS, OffloadDevice, OffloadError, Stored, Work
from .optim import LRScheduler, Optimizer
from .precision import Precision
from .zero_stage import ZeroStage, ZeroStageTraits

__all__ = ["Accelerator", "BYTE_ADDRESSABLE", "CheckpointView", "CompressionMethod", "LoadOptions", "LRScheduler",
           "Monitor", "NEEDS_SWAP_BUFFERS", "Observer", "OffloadDevice", "OffloadError", "Optimizer", "Precision",
           "SaveOptions", "Stored", "Work", "ZeroStage", "ZeroStageTraits"]
