"""Offloading over gloo with 2 processes.

One 2-process run trains, in fp32 and bf16, ZeRO stage 2 with the optimizer on the CPU, stage 3
with optimizer and parameters on the CPU, and stage 3 with both in swap files (a temp dir), plus
the same stages without offloading. The tests check each offloaded run against plain PyTorch on
the global batch (engine_common.reference_run) and against its stage without offloading, and that
the swap files existed under each rank's private directory during training and are gone after
``destroy()``.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.engine_common import reference_run
from tests.plugins.zero.test_zero3 import adamw

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD, STEPS = 2, 3
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def cases(nvme_root: str) -> dict:
    nvme = {"device": "nvme", "nvme_path": nvme_root}
    return {
        "stage2": {"stage": 2},
        "stage2-cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "stage3": {"stage": 3},
        "stage3-cpu-cpu": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "stage3-nvme-nvme": {"stage": 3, "sub_group_size": 150,
                             "offload_optimizer": {**nvme, "buffer_count": 6, "pipeline_read": True,
                                                   "pipeline_write": True},
                             "offload_param": {**nvme, "buffer_count": 2, "buffer_size": 300, "max_in_cpu": 200}},
    }


def _job(nvme_root: str):
    import dsplug
    from dsplug import comm

    from tests.plugins.zero.test_zero3 import SeededMLP, config, gathered, train

    out = {}
    for precision in (None, "bf16"):
        for name, zero in cases(nvme_root).items():
            cfg = config(WORLD, gas=2, clip=0.3, precision=precision, **zero)
            cfg["optimizer"] = ADAMW
            engine, *_ = dsplug.initialize(model=SeededMLP(), config=cfg)
            losses = train(engine, 1)
            store = getattr(engine.stage, "store", None)
            files = store.swap_files() if hasattr(store, "swap_files") else []
            losses += train(engine, STEPS - 1, start=1)
            params = gathered(engine.module) if zero["stage"] == 3 else \
                [p.detach().float().clone() for p in engine.module.parameters()]
            engine.destroy()
            left = [f for f in files if os.path.exists(f)]
            out[(name, precision)] = {"losses": losses, "params": params, "files": files, "left": left,
                                      "optimizer": type(engine.basic_optimizer).__name__}
    out["rank"] = comm.get_rank()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvme")
    by_rank = run_distributed(_job, WORLD, str(root))
    return {"ranks": by_rank, "root": root}


def _close(got, want, tol):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **tol)
    for a, b in zip(got["params"], want["params"]):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("name", ["stage2-cpu", "stage3-cpu-cpu", "stage3-nvme-nvme"])
def test_offloaded_training_equals_the_reference_and_the_stage_without_offload(results, name, precision):
    ref = reference_run(STEPS, WORLD, 4, 2, adamw, clip=0.3, precision=precision or "fp32")
    plain = "stage2" if name.startswith("stage2") else "stage3"
    for out in results["ranks"]:
        got = out[(name, precision)]
        assert got["optimizer"] == "DeepSpeedCPUAdam"
        _close(got, out[(plain, precision)], dict(rtol=1e-5, atol=1e-6))
        _close(got, ref, dict(rtol=2e-2, atol=2e-2) if precision else dict(rtol=1e-5, atol=1e-6))
    # every rank ends with the same full weights
    for a, b in zip(results["ranks"][0][(name, precision)]["params"], results["ranks"][1][(name, precision)]["params"]):
        assert torch.equal(a, b)


def test_swap_files_are_per_rank_private_and_removed_at_destroy(results):
    root = str(results["root"])
    for out in results["ranks"]:
        rank = out["rank"]
        for precision in (None, "bf16"):
            got = out[("stage3-nvme-nvme", precision)]
            dirs = {os.path.basename(os.path.dirname(f)) for f in got["files"]}
            assert len(dirs) == 2 and all(d.startswith(("dsplug-offload_optimizer-rank%d-" % rank,
                                                        "dsplug-offload_param-rank%d-" % rank)) for d in dirs)
            assert all(f.startswith(root) for f in got["files"])
            assert any(f.endswith("_exp_avg_sq.swp") for f in got["files"])
            assert any(os.path.basename(f).startswith("param") for f in got["files"])
            assert got["left"] == []
    assert os.listdir(root) == []
