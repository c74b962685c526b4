"""``deepspeed.runtime.data_pipeline.data_routing``: ``basic_layer``, ``helper`` and ``scheduler`` (random-LTD)."""
