"""Run from a source checkout without installing: put the package's folder on sys.path."""
import importlib.util
import pathlib
import sys

if importlib.util.find_spec("dsplug_fsdp") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
