"""DeepSpeed's data efficiency library: the ``data_efficiency`` config section.

* :mod:`.analyzer` -- ``DataAnalyzer``: per-sample metrics over a dataset in worker processes,
  reduced to the index files (:mod:`.index_files`) curriculum sampling reads;
* :mod:`.sampler` -- ``DeepSpeedDataSampler``: curriculum data sampling, the training loader's
  batch sampler (resumable mid-epoch);
* :mod:`.schedules` -- the difficulty / kept-token pacing functions;
* :mod:`.random_ltd` -- random layerwise token dropping (``RandomLayerTokenDrop``,
  ``convert_to_random_ltd``, ``RandomLTDScheduler``);
* :mod:`.observer` -- the engine observer and the engine methods;
* :mod:`.plugin` -- the registration: config schema (:mod:`.config`), the observer, the
  DeepSpeed import paths ``dsplug.runtime.data_pipeline.data_sampling.{data_analyzer,data_sampler}``
  and ``dsplug.runtime.data_pipeline.data_routing.{basic_layer,helper,scheduler}``.

See docs/data-efficiency.md.
"""
