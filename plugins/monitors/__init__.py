"""Monitor plugins: metric sinks that each own a DeepSpeed config section.

* :mod:`.tensorboard_monitor` — ``tensorboard``: TensorBoard event files (needs ``dsplug[tensorboard]``)
* :mod:`.csv_monitor` — ``csv_monitor``: one CSV file per metric (standard library only)
* :mod:`.wandb_monitor` — ``wandb``: a Weights & Biases run (needs ``dsplug[wandb]``)
* :mod:`.comet_monitor` — ``comet``: a Comet experiment (needs ``dsplug[comet]``)

Each factory returns ``None`` when its section is not enabled or on ranks other than 0 (only
rank 0 writes), else a :class:`~.events.MonitorObserver` (a :class:`dsplug.contracts.Monitor`
with a background writer thread) whose lifecycle hooks write the tags
DeepSpeed writes (``Train/Samples/train_loss``, ``Train/Samples/lr``, ...) keyed by samples seen.

:mod:`.plugin` (entry point ``monitors``) registers all four; their section schemas are in
:mod:`.config`.
"""
