"""Pipeline parallelism: DeepSpeed's ``deepspeed.pipe`` (``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec``), ``deepspeed.runtime.pipe`` (``.module``, ``.topology``, ``.engine``,
``.schedule``) and the ``PipelineEngine`` that ``dsplug.initialize`` returns for a
``PipelineModule``.

* :mod:`.topology` -- ``ProcessTopology`` and DeepSpeed's pipe/data/model topologies; the
  ``PipelineParallelGrid`` (process groups, the mpu interface);
* :mod:`.partition` -- stage boundaries ('parameters', 'uniform', 'type:REGEX');
* :mod:`.module` -- ``PipelineModule``, layer specs, tied weights, per-layer checkpoint files;
* :mod:`.schedule` -- the 1F1B training schedule and the inference schedule;
* :mod:`.p2p` -- activations and gradients between stages over ``dsplug.comm`` send / recv;
* :mod:`.engine` -- ``PipelineEngine``: the ordinary engine per stage, driven by the schedule;
* :mod:`.checkpoint` -- checkpoints that reload at another stage count.

Registered by :mod:`.plugin` through two service hooks: ``dsplug_api_modules`` (the import paths)
and ``dsplug_engine_factory`` (``initialize`` builds a ``PipelineEngine`` for a ``PipelineModule``).
"""
