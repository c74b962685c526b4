"""``dsplug.runtime.data_pipeline.data_sampling.data_analyzer``:
DeepSpeed's DataAnalyzer (offline metrics and index files).

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the data efficiency plugin); they are resolved on
first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
