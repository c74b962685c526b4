"""Run from a source checkout without installing: load the package from its folder (by file, so
that build leftovers there, such as an .egg-info, are not mistaken for an installed distribution)."""
import importlib.util
import pathlib
import sys

if importlib.util.find_spec("dsplug_mmap_offload") is None:
    package = pathlib.Path(__file__).resolve().parents[1] / "dsplug_mmap_offload"
    spec = importlib.util.spec_from_file_location("dsplug_mmap_offload", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["dsplug_mmap_offload"] = module
    spec.loader.exec_module(module)
