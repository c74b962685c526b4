"""Pipeline parts that need no second process: topologies against hand-written tables, stage
partitions against hand-computed boundaries (and exhaustive search), the 1F1B schedule simulated
over every stage, the import paths and the engine-factory hook."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from dsplug.plugins.pipe import partition as part
from dsplug.plugins.pipe import schedule as sched
from dsplug.plugins.pipe.module import LayerSpec, PipelineError, TiedLayerSpec, partition_layers
from dsplug.plugins.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                          ProcessTopology, default_topology)


@pytest.fixture(autouse=True)
def _forget_the_grid():
    """An engine built here leaves its grid as the process's mpu: forget it for the next tests."""
    yield
    from dsplug.utils import groups

    groups._reset_for_tests()


# ------------------------------------------------------------------ topology
def test_process_topology_is_row_major_over_its_axes():
    topo = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    table = {0: (0, 0), 1: (0, 1), 2: (0, 2), 3: (1, 0), 4: (1, 1), 5: (1, 2)}
    for rank, (x, y) in table.items():
        assert topo.get_coord(rank) == (x, y) and (topo.get_coord(rank).x, topo.get_coord(rank).y) == (x, y)
        assert topo.get_rank(x=x, y=y) == rank
    assert topo.world_size() == 6 and topo.get_dim("y") == 3 and topo.get_dim("z") == 0
    assert topo.get_axis_list("x", 0) == [0, 1, 2] and topo.get_axis_list("y", 0) == [0, 3]
    assert topo.get_axis_comm_lists("y") == [[0, 1, 2], [3, 4, 5]]
    assert topo.get_axis_comm_lists("x") == [[0, 3], [1, 4], [2, 5]]
    assert topo.get_axis_comm_lists("nope") == []
    assert topo.filter_match(y=1) == [1, 4]
    ab = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert ab.get_rank_repr(rank=3) == "a_01-b_01" and ab.get_rank_repr(rank=3, omit_axes=["a"]) == "b_01"


def test_pipe_data_topology_puts_a_stages_replicas_on_consecutive_ranks():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data"]
    assert [tuple(topo.get_coord(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert topo.get_axis_comm_lists("data") == [[0, 1], [2, 3]]     # gradient all-reduce groups
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]     # one replica's stages


def test_pipe_model_data_topology_table():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    for rank in range(8):  # rank = pipe * 4 + data * 2 + model
        c = topo.get_coord(rank)
        assert rank == c.pipe * 4 + c.data * 2 + c.model
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert topo.get_rank_repr(rank=5, omit_axes=("data", "pipe")) == "model_01"


def test_topology_errors_name_the_problem():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    with pytest.raises(ValueError, match="one coordinate per axis"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="data=2 is outside"):
        topo.get_rank(pipe=0, data=2)
    with pytest.raises(ValueError, match="rank 4 is not in"):
        topo.get_coord(4)
    with pytest.raises(ValueError, match="2 axes"):
        ProcessTopology(axes=["a", "b"], dims=[2])


def test_default_topology_deals_prime_factors_to_pipe_then_data():
    assert default_topology(8).dims == [4, 2]
    assert default_topology(6).dims == [2, 3]
    assert default_topology(1).dims == [1, 1]


def test_grid_of_one_process_answers_the_mpu_questions():
    from dsplug.plugins.pipe.topology import PipelineParallelGrid

    grid = PipelineParallelGrid(PipeDataParallelTopology(1, 1))
    assert (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()) == (0, 0, 1)
    assert (grid.get_model_parallel_rank(), grid.get_model_parallel_world_size()) == (0, 1)
    assert grid.get_pipe_parallel_world_size() == 1 and grid.is_first_stage and grid.is_last_stage
    with pytest.raises(ValueError, match="has 4 ranks but the world has 1"):
        PipelineParallelGrid(PipeDataParallelTopology(2, 2))


# ------------------------------------------------------------------ partitions
def _stack():
    # parameters: 20, 0, 40, 0, 18
    return [LayerSpec(nn.Linear, 4, 4), nn.ReLU(), LayerSpec(nn.Linear, 4, 8), nn.ReLU(), nn.Linear(8, 2)]


def test_partition_by_parameters_matches_hand_computed_boundaries():
    # 2 stages: the best split has 58 = 40 + 0 + 18 on the heavier side: [20, 0 | 40, 0, 18]
    assert partition_layers(_stack(), 2, "parameters") == [0, 2, 5]
    # 3 stages: bottleneck 40: [20, 0 | 40, 0 | 18]
    assert partition_layers(_stack(), 3, "parameters") == [0, 2, 4, 5]
    assert partition_layers(_stack(), 1, "parameters") == [0, 5]


def test_partition_uniform_and_by_type_match_hand_computed_boundaries():
    assert partition_layers(_stack(), 2, "uniform") == [0, 3, 5]
    assert part.partition_uniform(7, 3) == [0, 3, 5, 7]
    assert part.partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    # marks [1, 0, 1, 0, 1]: two Linears on stage 0 (the ReLU after the second stays with it), one after
    assert partition_layers(_stack(), 2, "type:linear") == [0, 4, 5]
    assert partition_layers(_stack(), 3, "type:^lin") == [0, 2, 4, 5]
    # marks [0, 1, 0, 1, 0]: bottleneck 1; the Linear after the first ReLU weighs 0 and stays on stage 0
    assert partition_layers(_stack(), 2, "type:ReLU") == [0, 3, 5]


def test_partition_errors_name_the_method_and_the_layers():
    with pytest.raises(PipelineError, match="matches no layer.*Linear, ReLU"):
        partition_layers(_stack(), 2, "type:conv")
    with pytest.raises(PipelineError, match="'profile'"):
        partition_layers(_stack(), 2, "profile")
    with pytest.raises(PipelineError, match="bad regular expression"):
        partition_layers(_stack(), 2, "type:(")


def test_counting_a_layer_spec_builds_it_on_meta_and_leaves_the_rng_alone():
    state = torch.random.get_rng_state()
    partition_layers([LayerSpec(nn.Linear, 64, 64) for _ in range(4)], 2, "parameters")
    assert torch.equal(state, torch.random.get_rng_state())


def _brute_bottleneck(w, s):
    n = len(w)
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), s - 1):
        bounds = [0, *cuts, n]
        heaviest = max(sum(w[bounds[i]:bounds[i + 1]]) for i in range(s))
        best = heaviest if best is None else min(best, heaviest)
    return best


def test_balanced_partition_reaches_the_exhaustive_optimum_with_every_stage_non_empty():
    rng = random.Random(0)
    for _ in range(400):
        n, s = rng.randint(0, 8), rng.randint(1, 5)
        w = [rng.choice([0, 0, 1, 2, 3, 5, 10]) for _ in range(n)]
        bounds = part.partition_balanced(w, s)
        assert len(bounds) == s + 1 and bounds[0] == 0 and bounds[-1] == n
        assert all(a <= b for a, b in zip(bounds, bounds[1:]))
        assert max(sum(w[bounds[i]:bounds[i + 1]]) for i in range(s)) == _brute_bottleneck(w, s), (w, s, bounds)
        if n >= s:
            assert all(a < b for a, b in zip(bounds, bounds[1:])), (w, s, bounds)


def test_layer_specs_validate_their_arguments():
    with pytest.raises(PipelineError, match="torch.nn.Module subclass"):
        LayerSpec(lambda: None)
    with pytest.raises(PipelineError, match="tied_weight_attr"):
        TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr=[])
    assert repr(LayerSpec(nn.Linear, 2, 3, bias=False)) == "LayerSpec(Linear, 2, 3, bias=False)"


# ------------------------------------------------------------------ schedules
def _simulate(schedules):
    """Run every stage's instruction stream: sends never block, a receive waits for its message.
    Returns each stage's executed instructions; raises on a deadlock or a message out of order."""
    streams = [[ins for step in s for ins in step] for s in schedules]
    pc = [0] * len(streams)
    acts = {s: [] for s in range(len(streams))}   # messages to stage s (activations)
    grads = {s: [] for s in range(len(streams))}  # messages to stage s (gradients)
    done = [[] for _ in streams]
    while any(p < len(st) for p, st in zip(pc, streams)):
        progressed = False
        for s, stream in enumerate(streams):
            while pc[s] < len(stream):
                ins = stream[pc[s]]
                if isinstance(ins, sched.SendActivation):
                    acts[s + 1].append(ins.micro_batch)
                elif isinstance(ins, sched.SendGrad):
                    grads[s - 1].append(ins.micro_batch)
                elif isinstance(ins, (sched.RecvActivation, sched.RecvGrad)):
                    box = acts[s] if isinstance(ins, sched.RecvActivation) else grads[s]
                    if not box:
                        break
                    assert box.pop(0) == ins.micro_batch, f"stage {s} got micro-batch out of order at {ins}"
                done[s].append(ins)
                pc[s] += 1
                progressed = True
        if not progressed:
            waiting = [st[p] if p < len(st) else None for p, st in zip(pc, streams)]
            raise AssertionError(f"deadlock: stages wait at {waiting}")
    return done


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 6])
def test_train_schedule_is_1f1b_and_deadlock_free(stages, micro_batches):
    schedules = [sched.TrainSchedule(micro_batches, stages, s) for s in range(stages)]
    done = _simulate(schedules)
    for s, executed in enumerate(done):
        fwd = [i.micro_batch for i in executed if isinstance(i, sched.ForwardPass)]
        bwd = [i.micro_batch for i in executed if isinstance(i, sched.BackwardPass)]
        assert fwd == list(range(micro_batches)) and bwd == list(range(micro_batches))
        # activations held (forward done, backward not yet) never exceed min(S - s, M)
        held, peak = 0, 0
        for i in executed:
            held += isinstance(i, sched.ForwardPass) - isinstance(i, sched.BackwardPass)
            peak = max(peak, held)
        assert peak == schedules[s].num_pipe_buffers() == min(stages - s, micro_batches)
        assert [type(i) for i in executed[-3:]] == [sched.ReduceTiedGrads, sched.ReduceGrads, sched.OptimizerStep]
        loads = [i for i in executed if isinstance(i, sched.LoadMicroBatch)]
        assert len(loads) == (micro_batches if s in (0, stages - 1) else 0)
    # the last stage alternates forward and backward from the start
    last = [type(i) for i in done[-1] if isinstance(i, (sched.ForwardPass, sched.BackwardPass))]
    assert last == [sched.ForwardPass, sched.BackwardPass] * micro_batches


def test_inference_schedule_forwards_in_order():
    done = _simulate([sched.InferenceSchedule(3, 2, s) for s in range(2)])
    assert [repr(i) for i in done[1]] == ["LoadMicroBatch(micro_batch=0)", "RecvActivation(micro_batch=0)",
                                          "ForwardPass(micro_batch=0)", "LoadMicroBatch(micro_batch=1)",
                                          "RecvActivation(micro_batch=1)", "ForwardPass(micro_batch=1)",
                                          "LoadMicroBatch(micro_batch=2)", "RecvActivation(micro_batch=2)",
                                          "ForwardPass(micro_batch=2)"]


# ------------------------------------------------------------------ import paths, the engine factory
def test_deepspeed_import_paths_resolve_to_the_plugin():
    import dsplug
    import dsplug.runtime.pipe.engine
    import dsplug.runtime.pipe.module
    from dsplug.plugins.pipe import engine, module, schedule, topology
    from dsplug.unavailable import attribute_error, module_error

    assert dsplug.pipe.PipelineModule is module.PipelineModule is dsplug.PipelineModule
    assert dsplug.pipe.LayerSpec is module.LayerSpec and dsplug.pipe.TiedLayerSpec is module.TiedLayerSpec
    assert dsplug.PipelineEngine is engine.PipelineEngine is dsplug.runtime.pipe.engine.PipelineEngine
    assert dsplug.runtime.pipe.ProcessTopology is topology.ProcessTopology
    assert dsplug.runtime.pipe.topology.PipeDataParallelTopology is topology.PipeDataParallelTopology
    assert dsplug.runtime.pipe.schedule.TrainSchedule is schedule.TrainSchedule
    assert dsplug.runtime.pipe.module.PipelineModule is module.PipelineModule
    assert module_error("deepspeed.pipe") is None and module_error("deepspeed.runtime.pipe.module") is None
    assert attribute_error("PipelineModule") is None


def test_engine_factory_hook_answers_for_pipeline_modules_only():
    from dsplug.plugins.pipe.engine import PipelineEngine
    from dsplug.plugins.pipe.module import PipelineModule
    from dsplug.registry import get_registry

    hook = get_registry().pm.hook.dsplug_engine_factory
    assert hook(model=nn.Linear(2, 2), mpu=None) is None
    model = PipelineModule([nn.Linear(2, 2)], num_stages=1)
    assert hook(model=model, mpu=None) is PipelineEngine


class _Marked(nn.Linear):
    """A model class a runtime plugin claims."""


def test_initialize_builds_the_engine_class_a_plugin_names():
    import types

    import dsplug
    from dsplug import hookimpl
    from dsplug.engine import Engine
    from dsplug.registry import get_registry

    class MarkedEngine(Engine):
        pass

    plugin = types.ModuleType("marked_engine_plugin")
    plugin.dsplug_engine_factory = hookimpl(lambda model, mpu: MarkedEngine if isinstance(model, _Marked) else None)
    registry = get_registry()
    registry.register(plugin)
    try:
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = dsplug.initialize(model=_Marked(2, 2), config=cfg)
        assert type(engine) is MarkedEngine
        engine, *_ = dsplug.initialize(model=nn.Linear(2, 2), config=cfg)
        assert type(engine) is Engine
    finally:
        registry.pm.unregister(plugin)


def test_deepspeed_alias_serves_the_pipe_modules():
    import importlib
    import sys

    import dsplug
    from dsplug.plugins.deepspeed_alias import finder

    if "deepspeed" in sys.modules:
        pytest.skip("a module named deepspeed is already imported")
    try:
        finder.install()
        import deepspeed.pipe
        import deepspeed.runtime.pipe.topology

        assert deepspeed.pipe.PipelineModule is dsplug.pipe.PipelineModule
        assert deepspeed.runtime.pipe.topology is importlib.import_module("dsplug.runtime.pipe.topology")
        assert deepspeed.PipelineEngine is dsplug.PipelineEngine
    finally:
        finder.uninstall()


def test_prime_factors_of_a_non_positive_world_is_a_value_error():
    from dsplug.plugins.pipe.topology import _prime_factors

    assert _prime_factors(1) == [] and _prime_factors(12) == [2, 2, 3] and _prime_factors(13) == [13]
    for n in (0, -4):
        with pytest.raises(ValueError, match="positive integer"):
            _prime_factors(n)
