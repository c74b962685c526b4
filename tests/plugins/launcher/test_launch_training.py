"""`dsplug launch --num_procs 2` of an unmodified DeepSpeed-style training script."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from tests.plugins.launcher.test_launcher import dsplug_launch  # noqa: F401  (fixture)

SCRIPT = textwrap.dedent(
    """
    import argparse, json
    import torch
    import dsplug as deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=model,
                                                        model_parameters=model.parameters(), training_data=data)
    losses = []
    for epoch in range(4):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    rank = deepspeed.comm.get_rank()
    torch.save({"losses": losses, "params": [p.detach() for p in engine.module.parameters()],
                "world": deepspeed.comm.get_world_size(), "local_rank": args.local_rank,
                "steps": engine.global_steps}, f"{args.out}.{rank}.pt")
    """
)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_two_processes_of_a_training_script(tmp_path, dsplug_launch):  # noqa: F811
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 16, "steps_per_print": 100,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}))
    done = dsplug_launch(script, "--deepspeed_config", config, "--out", tmp_path / "result")
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"result.{r}.pt") for r in range(2)]
    for r, result in enumerate(ranks):
        assert result["world"] == 2 and result["local_rank"] == r
        assert result["steps"] == 4 * 64 // 16  # 4 epochs of 64 samples, 16 per optimizer step
        assert sum(result["losses"][-4:]) < sum(result["losses"][:4])
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
