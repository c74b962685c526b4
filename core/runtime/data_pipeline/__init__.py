"""DeepSpeed's ``deepspeed.runtime.data_pipeline`` import paths (the data efficiency library).

* :mod:`.data_sampling` -- ``data_analyzer`` (``DataAnalyzer``) and ``data_sampler``
  (``DeepSpeedDataSampler``);
* :mod:`.data_routing` -- ``basic_layer`` (``RandomLayerTokenDrop``), ``helper``
  (``convert_to_random_ltd``, ``save_without_random_ltd``, ``remove_random_ltd_state_dict``) and
  ``scheduler`` (``RandomLTDScheduler``).

The names in the leaf modules come from the plugin that declares them through the
``dsplug_api_modules`` hook (dsplug's own: the data efficiency plugin); see :mod:`dsplug.public`.
"""
