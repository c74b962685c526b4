"""DeepSpeed 0.19.8's ZeRO memory estimators as numbers, for tests/plugins/zero/test_memory_estimators.py.

DeepSpeed is a black box here, never a dependency: run this in a separate virtual environment
(see make_fixtures.py for its setup)::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(mktemp -d) /work/venvs/ds/bin/python \
        tests/data/deepspeed/make_memory_estimates.py

It writes ``memory_estimates.json``: the (cpu, gpu[, largest layer]) bytes that
``estimate_zero3_model_states_mem_needs`` / ``estimate_zero2_model_states_mem_needs`` return over a
grid of arguments, the (total, largest layer) parameter counts ``model_to_params`` gives for the
models of :func:`models`, and the text the ``*_all_live`` / ``*_all_cold`` functions print.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def models():
    """name -> model (importable without DeepSpeed: the dsplug test builds the same ones)."""
    torch.manual_seed(0)
    nested = torch.nn.Sequential(torch.nn.Linear(1000, 2000),
                                 torch.nn.Sequential(torch.nn.Linear(2000, 3000), torch.nn.LayerNorm(3000)),
                                 torch.nn.Embedding(5000, 100))
    tied = torch.nn.Sequential(torch.nn.Embedding(300, 40), torch.nn.Linear(40, 300, bias=False))
    tied[1].weight = tied[0].weight  # a shared parameter
    frozen = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    frozen[0].requires_grad_(False)
    return {"nested": nested, "tied": tied, "frozen": frozen}


GRID_TOTALS = (1000, 12345, 2783000000)
GRID_LARGEST = (10, 777, 65000000)
GRID_GPUS = ((1, 1), (2, 1), (8, 2), (3, 5))
GRID_BUFFER = (1.5, 1.0)

PRINTED = [  # (function, kwargs): what the all_live / all_cold functions print
    ("z3_cold", dict(total_params=2783e6, largest_layer_params=65e6, num_gpus_per_node=1, num_nodes=1)),
    ("z3_cold", dict(total_params=2783e6, largest_layer_params=65e6, num_gpus_per_node=2, num_nodes=1)),
    ("z3_cold", dict(total_params=2783000000, largest_layer_params=65000000, num_gpus_per_node=8, num_nodes=2,
                     additional_buffer_factor=1.0)),
    ("z3_cold", dict(total_params=8600000, largest_layer_params=1500000, num_gpus_per_node=1, num_nodes=1)),
    ("z2_cold", dict(total_params=2783e6, num_gpus_per_node=1, num_nodes=1)),
    ("z2_cold", dict(total_params=12345678, num_gpus_per_node=4, num_nodes=3)),
    ("z3_live", dict(model="nested", num_gpus_per_node=1, num_nodes=1)),
    ("z3_live", dict(model="nested", num_gpus_per_node=2, num_nodes=3)),
    ("z2_live", dict(model="nested", num_gpus_per_node=4, num_nodes=2)),
    ("z2_live", dict(model="tied", num_gpus_per_node=1, num_nodes=1)),
]


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
    from deepspeed.runtime.zero import stage3 as s3
    from deepspeed.runtime.zero import stage_1_and_2 as s12

    import deepspeed

    functions = {"z3_cold": s3.estimate_zero3_model_states_mem_needs_all_cold,
                 "z3_live": s3.estimate_zero3_model_states_mem_needs_all_live,
                 "z2_cold": s12.estimate_zero2_model_states_mem_needs_all_cold,
                 "z2_live": s12.estimate_zero2_model_states_mem_needs_all_live}
    built = models()
    out = {"deepspeed": deepspeed.__version__, "zero3": [], "zero2": [], "model_to_params": {}, "printed": []}
    for total, largest, (gpus, nodes), buffer, offload, offload_params, zero_init in itertools.product(
            GRID_TOTALS, GRID_LARGEST, GRID_GPUS, GRID_BUFFER, (True, False), (True, False), (True, False)):
        args = dict(total_params=total, largest_layer_params=largest, num_gpus_per_node=gpus, num_nodes=nodes,
                    cpu_offload=offload, cpu_offload_params=offload_params, zero_init=zero_init,
                    additional_buffer_factor=buffer)
        out["zero3"].append([args, list(s3.estimate_zero3_model_states_mem_needs(**args))])
    for total, (gpus, nodes), buffer, offload in itertools.product(GRID_TOTALS, GRID_GPUS, GRID_BUFFER, (True, False)):
        args = dict(total_params=total, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=offload,
                    additional_buffer_factor=buffer)
        out["zero2"].append([args, list(s12.estimate_zero2_model_states_mem_needs(**args))])
    for name, model in built.items():
        out["model_to_params"][name] = list(s3.model_to_params(model))
    for function, kwargs in PRINTED:
        call = dict(kwargs)
        if "model" in call:
            call["model"] = built[call["model"]]
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            returned = functions[function](**call)
        out["printed"].append({"function": function, "kwargs": kwargs, "stdout": text.getvalue(),
                               "returned": returned})
    write_json(os.path.join(HERE, "memory_estimates.json"), out)
    print(f"wrote {len(out['zero3'])} + {len(out['zero2'])} estimates, {len(out['printed'])} tables")


if __name__ == "__main__":
    main()
