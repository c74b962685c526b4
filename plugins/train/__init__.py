"""``dsplug train``: a small character-level transformer language model trained end to end.

The built-in job behind the first command of the README: a decoder-only transformer
(:mod:`.model`) learns the shipped corpus (:mod:`.data`) through ``dsplug.initialize`` with a
DeepSpeed-format config (``default_config.json`` unless one is given), on one process or on
``--nproc N`` processes started through the dsplug launcher. :mod:`.loop` is the job itself;
``python -m dsplug.plugins.train`` is what each launched worker runs. :mod:`.cli` is the
``dsplug train`` command, registered by :mod:`.plugin` (entry point ``train``).
"""
