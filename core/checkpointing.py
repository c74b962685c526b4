"""``dsplug.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` API for activation
checkpointing (``configure``, ``is_configured``, ``reset``, ``checkpoint``,
``get_cuda_rng_tracker``, ``model_parallel_cuda_manual_seed``, ``CudaRNGStatesTracker`` ...).

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the activation checkpointing plugin's
``checkpointing`` module); they are resolved on first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
