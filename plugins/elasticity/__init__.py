"""Elastic training (DeepSpeed's ``elasticity`` section and ``deepspeed.elasticity``).

* :mod:`.constants` -- the section's keys and defaults (DeepSpeed's names)
* :mod:`.config` -- the section's schema, DeepSpeed's ``ElasticityConfig`` and error classes
* :mod:`.search` -- the integer search: highly composite candidates, valid GPU counts
* :mod:`.elasticity` -- ``compute_elastic_config``, ``elasticity_enabled``, ``ensure_immutable_elastic_config``
* :mod:`.api` -- the ``dsplug.elasticity`` import path
* :mod:`.batch` -- the batch sizes at ``initialize`` (the kernel's ``dsplug_batch_sizes`` hook)
* :mod:`.plugin` -- registration: the section, the batch sizes, the import paths

The launcher side (``dsplug launch --elastic_training``) is :mod:`dsplug.plugins.launcher.elastic`.
See docs/elasticity.md.
"""
