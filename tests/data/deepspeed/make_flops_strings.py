"""DeepSpeed 0.19.8's flops-profiler number strings, for tests/plugins/profilers/test_flops_strings_deepspeed.py.

DeepSpeed is a black box here, never a dependency: run this in a separate virtual environment
(see make_fixtures.py for its setup)::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(mktemp -d) /work/venvs/ds/bin/python \
        tests/data/deepspeed/make_flops_strings.py

It writes ``flops_strings.json``: what ``number_to_string``, ``macs_to_string``,
``flops_to_string``, ``params_to_string``, ``duration_to_string`` and ``bytes_to_string`` of
``deepspeed.profiling.flops_profiler`` return over :data:`VALUES` x :data:`UNITS` x
:data:`PRECISIONS`, and the strings ``get_model_profile`` returns for :func:`model`.
"""
from __future__ import annotations

import itertools
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FUNCTIONS = ("number_to_string", "macs_to_string", "flops_to_string", "params_to_string", "duration_to_string",
             "bytes_to_string")
VALUES = (0, 1, 7, 999, 1000, 995970, 488700, 33310, 1234567, 2.5e12, 3.75e9, 1.5e15, 0.5, 0.0012, 7.639e-5,
          2e-7, 123.456789, 1e3 - 0.001, -4200)
UNITS = (None, "T", "G", "M", "K", "", "m", "u")
PRECISIONS = (2, 3, 0)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


INPUT_SHAPE = (4, 64)


def write_json(path: str, out: dict) -> None:
    """``out`` with each top-level list written one element per line (a readable, small diff)."""
    parts = []
    for key, value in out.items():
        if isinstance(value, list):
            rows = ",\n".join("  " + json.dumps(row) for row in value)
            parts.append(f" {json.dumps(key)}: [\n{rows}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(parts) + "\n}\n")


def main():
    import deepspeed
    from deepspeed.profiling.flops_profiler import profiler as P

    out = {"deepspeed": deepspeed.__version__, "strings": []}
    for name, value, units, precision in itertools.product(FUNCTIONS, VALUES, UNITS, PRECISIONS):
        try:
            text = getattr(P, name)(value, units=units, precision=precision)
        except Exception as exc:  # noqa: BLE001 - recorded as what DeepSpeed does
            text = f"<{type(exc).__name__}>"
        out["strings"].append([name, value, units, precision, text])
    flops, macs, params = P.get_model_profile(model(), input_shape=INPUT_SHAPE, print_profile=False, as_string=True)
    out["model_profile"] = {"flops": flops, "macs": macs, "params": params}
    write_json(os.path.join(HERE, "flops_strings.json"), out)
    print(len(out["strings"]), "strings;", out["model_profile"])


if __name__ == "__main__":
    main()
