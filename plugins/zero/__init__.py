"""ZeRO (``zero_optimization``): the section, the stages 0-3, and what they share.

Entry points (each module holds hooks only):

* :mod:`.plugin`         the ``zero_optimization`` section (schema :mod:`.config`), memory
  estimates (:mod:`.memory`), ``"auto"`` values, ``dsplug zero-to-fp32`` (:mod:`.cli`), DeepSpeed's
  config names (:mod:`.ds_config`)
* :mod:`.stage0.plugin`  stage ``"0"``: data parallel with gradient buckets
* :mod:`.stage12.plugin` stages ``"1"`` and ``"2"``: flat partitions of optimizer state (and gradients)
* :mod:`.stage3.plugin`  stage ``"3"``: parameters partitioned too, ``dsplug.zero`` (Init, ...), ZeRO++

Shared by the stages: :mod:`.partitioning` (layouts, gradient clipping, the optimizer checks,
state in offload devices through the storage contract) and :mod:`.checkpoint` (the partitioned
checkpoint format, DeepSpeed's format, zero_to_fp32). A stage imports these, never another stage.
"""
