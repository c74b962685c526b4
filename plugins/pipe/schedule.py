"""Pipeline schedules: the order in which one stage runs its instructions for a batch.

A schedule is an iterable of steps; each step is a list of :class:`PipeInstruction` that the
engine executes in order. Instructions name the micro-batch they act on.

:class:`TrainSchedule` is the 1F1B schedule (one forward, one backward): stage ``s`` of ``S``
first runs ``w = min(S - s - 1, M)`` forward passes (warm-up), then alternates one forward and one
backward until its ``M`` forwards are done, then runs the remaining ``w`` backwards (cool-down),
and ends with the tied-weight and data-parallel gradient reductions and the optimizer step.
Backwards run in micro-batch order, so gradients accumulate in the same order on every stage,
and a stage never holds more than ``min(S - s, M)`` micro-batches' activations
(:meth:`PipeSchedule.num_pipe_buffers`), against ``M`` for running every forward first.

Sends are asynchronous and receives block, so a stage waits only for the data it needs next; the
1F1B order makes those waits acyclic (stage ``s+1`` sends the gradient of micro-batch ``i``
after its forward of micro-batch ``w - 1 + i``, whose activation stage ``s`` sent before it
waits for that gradient).

:class:`InferenceSchedule` runs the ``M`` forward passes only.
"""
from __future__ import annotations

import abc
from typing import Iterator, List


class PipeInstruction:
    """One thing a stage does; keyword arguments become attributes (``micro_batch``)."""

    def __init__(self, **kwargs):
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class LoadMicroBatch(PipeInstruction):
    """Read the next micro-batch from the data iterator (inputs on the first stage, labels on the last)."""

    def __init__(self, micro_batch: int):
        super().__init__(micro_batch=micro_batch)


class ForwardPass(PipeInstruction):
    def __init__(self, micro_batch: int):
        super().__init__(micro_batch=micro_batch)


class BackwardPass(PipeInstruction):
    def __init__(self, micro_batch: int):
        super().__init__(micro_batch=micro_batch)


class SendActivation(PipeInstruction):
    def __init__(self, micro_batch: int):
        super().__init__(micro_batch=micro_batch)


class RecvActivation(PipeInstruction):
    def __init__(self, micro_batch: int):
        super().__init__(micro_batch=micro_batch)


class SendGrad(PipeInstruction):
    def __init__(self, micro_batch: int):
        super().__init__(micro_batch=micro_batch)


class RecvGrad(PipeInstruction):
    def __init__(self, micro_batch: int):
        super().__init__(micro_batch=micro_batch)


class ReduceTiedGrads(PipeInstruction):
    """Sum the tied weights' gradients over the stages that share them."""


class ReduceGrads(PipeInstruction):
    """Average gradients over the stage's data-parallel replicas (the ZeRO stage's reduction)."""


class OptimizerStep(PipeInstruction):
    pass


class PipeSchedule(abc.ABC):
    """The steps of one stage for one batch of ``micro_batches`` micro-batches."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1:
            raise ValueError(f"a pipeline schedule needs at least one micro-batch, got {micro_batches}")
        if not 0 <= stage_id < stages:
            raise ValueError(f"stage_id {stage_id} is outside [0, {stages - 1}]")
        self.micro_batches = int(micro_batches)
        self.stages = int(stages)
        self.stage_id = int(stage_id)
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    @abc.abstractmethod
    def steps(self) -> Iterator[List[PipeInstruction]]:
        """The steps, each a list of instructions run in order."""

    def __iter__(self):
        return iter(self.steps())

    def num_pipe_buffers(self) -> int:
        """The most micro-batches whose activations this stage holds at once."""
        return self.micro_batches

    def _forward(self, mb: int) -> List[PipeInstruction]:
        step: List[PipeInstruction] = []
        if self.is_first_stage or self.is_last_stage:
            step.append(LoadMicroBatch(mb))
        if not self.is_first_stage:
            step.append(RecvActivation(mb))
        step.append(ForwardPass(mb))
        if not self.is_last_stage:
            step.append(SendActivation(mb))
        return step

    def _backward(self, mb: int) -> List[PipeInstruction]:
        step: List[PipeInstruction] = []
        if not self.is_last_stage:
            step.append(RecvGrad(mb))
        step.append(BackwardPass(mb))
        if not self.is_first_stage:
            step.append(SendGrad(mb))
        return step


class TrainSchedule(PipeSchedule):
    """1F1B: warm-up forwards, alternating forward / backward, cool-down backwards, then the step."""

    def warmup(self) -> int:
        return min(self.stages - self.stage_id - 1, self.micro_batches)

    def steps(self) -> Iterator[List[PipeInstruction]]:
        w, m = self.warmup(), self.micro_batches
        for mb in range(w):
            yield self._forward(mb)
        for i in range(m - w):
            yield self._forward(w + i)
            yield self._backward(i)
        for mb in range(m - w, m):
            yield self._backward(mb)
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]

    def num_pipe_buffers(self) -> int:
        return min(self.stages - self.stage_id, self.micro_batches)


class InferenceSchedule(PipeSchedule):
    """Forward passes only."""

    def steps(self) -> Iterator[List[PipeInstruction]]:
        for mb in range(self.micro_batches):
            yield self._forward(mb)

    def num_pipe_buffers(self) -> int:
        return 1  # a micro-batch's activations are dropped once sent
