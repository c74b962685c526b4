"""``deepspeed.runtime.data_pipeline.data_sampling``: ``data_analyzer`` and ``data_sampler``."""
