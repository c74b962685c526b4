"""DeepSpeed's legacy curriculum learning (the top-level ``curriculum_learning`` section).

The schedule (:mod:`.scheduler`), its config (:mod:`.config`) and the engine observer that passes
``curriculum_seqlen`` to the model's forward (:mod:`.observer`), registered by :mod:`.plugin`. The
newer data-efficiency curriculum (``data_efficiency.data_sampling.curriculum_learning``) is
another plugin's.
"""
