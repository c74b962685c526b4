"""Process topologies and the pipeline grid: which rank holds which (pipe, data, model) coordinate,
and the process groups built from them.

:class:`ProcessTopology` maps n-dimensional Cartesian coordinates to linear ranks in row-major
order over its axes: with ``axes=['x', 'y']`` the coordinates ``(x, y)`` and ``(x, y + 1)`` are
adjacent ranks. DeepSpeed's two specializations keep that convention with the pipeline axis
outermost:

* :class:`PipeDataParallelTopology` -- ``axes=['pipe', 'data']``: the ranks of one stage are
  consecutive, so gradient reductions (data axis) stay on close (intra-node) links while the
  lower-volume activations cross between stages;
* :class:`PipeModelDataParallelTopology` -- ``axes=['pipe', 'data', 'model']``: tensor slices
  (model axis) innermost, then data, then pipe.

:class:`PipelineParallelGrid` creates the process groups of a topology and answers DeepSpeed's
model-parallel unit (mpu) questions, so it can be handed to ``dsplug.initialize(mpu=...)``:

* data-parallel group: the ranks that differ only in the ``data`` coordinate (they hold the same
  layers and average their gradients);
* pipe-parallel group: the ranks that differ only in ``pipe`` (one model replica's stages);
* model-parallel group (DeepSpeed's meaning for a pipeline): every rank with this rank's ``data``
  coordinate -- all stages (and tensor slices) of one replica, i.e. the ranks that together hold
  one copy of the model; ``get_model_parallel_rank`` is the position in it, which names the
  checkpoint file ``mp_rank_XX`` of a stage;
* slice group: the ``model`` axis (tensor slicing), present when that axis has more than one rank;
* p2p: the previous / next stage's rank with the same data and model coordinates. torch's
  point-to-point ops address global ranks directly, so no process group is made for a pair.
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product
from typing import Dict, List, Optional, Sequence


class ProcessTopology:
    """Maps coordinates on named axes to linear ranks (row-major: the last axis varies fastest).

    >>> topo = ProcessTopology(axes=['x', 'y'], dims=[2, 3])
    >>> topo.get_rank(x=0, y=1)
    1
    >>> topo.get_coord(rank=4)
    ProcessCoord(x=1, y=1)
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}; give one size per "
                             "axis")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be unique, got {axes}")
        for name, d in zip(axes, dims):
            if d < 1:
                raise ValueError(f"ProcessTopology: axis {name!r} has size {d}; every axis needs at least 1 rank")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self.mapping: Dict[tuple, int] = {}
        for rank, coord in enumerate(product(*(range(d) for d in dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank
        self._coords = {rank: coord for coord, rank in self.mapping.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"

    def _check_axis(self, axis: str) -> None:
        if axis not in self.axes:
            raise ValueError(f"axis {axis!r} is not in this topology; its axes are {self.axes}")

    def get_rank(self, **coord_kwargs) -> int:
        """The rank at the given coordinates (every axis must be given)."""
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(f"get_rank needs one coordinate per axis {self.axes}, got {sorted(coord_kwargs)}")
        for axis, value in coord_kwargs.items():
            d = self.dims[self.axes.index(axis)]
            if not 0 <= int(value) < d:
                raise ValueError(f"coordinate {axis}={value} is outside [0, {d - 1}]")
        return self.mapping[self.ProcessCoord(**{a: int(v) for a, v in coord_kwargs.items()})]

    def get_coord(self, rank: int):
        """The coordinates of ``rank`` as a namedtuple whose fields are the axes."""
        if rank not in self._coords:
            raise ValueError(f"rank {rank} is not in this topology of {self.world_size()} ranks")
        return self._coords[rank]

    def get_axis_names(self) -> List[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The number of ranks along ``axis`` (0 when the topology has no such axis, as DeepSpeed)."""
        if axis not in self.axes:
            return 0
        return self.dims[self.axes.index(axis)]

    def world_size(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-") -> str:
        """A string naming ``rank``'s coordinates on the axes not omitted, e.g. ``'model_01'``
        (used in checkpoint file names)."""
        coord = self.get_coord(rank)
        parts = [f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit_axes]
        return outer_sep.join(parts)

    def get_axis_list(self, axis: str, idx: int) -> List[int]:
        """The ranks whose coordinate on ``axis`` is ``idx``."""
        self._check_axis(axis)
        i = self.axes.index(axis)
        return sorted(rank for coord, rank in self.mapping.items() if coord[i] == idx)

    def filter_match(self, **filter_kwargs) -> List[int]:
        """The ranks whose coordinates equal every given ``axis=value``."""
        for axis in filter_kwargs:
            self._check_axis(axis)
        return sorted(rank for coord, rank in self.mapping.items()
                      if all(getattr(coord, a) == v for a, v in filter_kwargs.items()))

    def get_axis_comm_lists(self, axis: str) -> List[List[int]]:
        """One list of ranks per combination of the OTHER axes' coordinates: the ranks that differ
        only along ``axis`` (the members of one communicator along it). Empty for an unknown axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for coord in product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, coord))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: ``axes=['pipe', 'data']`` (data innermost: a stage's replicas
    are consecutive ranks)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor-slicing) parallelism: ``axes=['pipe', 'data', 'model']``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> List[int]:
    """The prime factors of ``n`` in ascending order (``[]`` for 1). ValueError for ``n < 1``: a
    world of no processes has no factorization (the loop would return ``[]`` as for 1)."""
    if n < 1:
        raise ValueError(f"prime factors of {n}: need a positive integer (a world size)")
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """DeepSpeed's grid without a topology: the world's prime factors dealt alternately to the pipe
    and data axes (pipe first)."""
    pp = dp = 1
    for i, prime in enumerate(_prime_factors(world_size)):
        if i % 2 == 0:
            pp *= prime
        else:
            dp *= prime
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)


class GroupCache:
    """Creates process groups through ``dsplug.comm.new_group`` once per distinct rank list (every
    rank must ask for every group, in the same order, as torch requires); the world's rank list is
    the default group itself."""

    def __init__(self, comm):
        self.comm = comm
        self.groups: Dict[tuple, object] = {}

    def get(self, ranks: Sequence[int]):
        key = tuple(sorted(int(r) for r in ranks))
        if key not in self.groups:
            if not self.comm.is_initialized():
                self.groups[key] = None
            elif len(key) == self.comm.get_world_size():
                self.groups[key] = self.comm.get_world_group()
            else:
                self.groups[key] = self.comm.new_group(list(key))
        return self.groups[key]


class PipelineParallelGrid:
    """The process groups of a pipeline topology and DeepSpeed's mpu interface.

    ``topology`` defaults to :func:`default_topology` over the world. The default process group must
    exist (``dsplug.init_distributed()``) unless the world is one process; the topology must cover
    the whole world.
    """

    def __init__(self, topology: Optional[ProcessTopology] = None, process_group=None):
        from dsplug import comm

        if process_group is not None:
            raise ValueError("PipelineParallelGrid: process_group is not supported; the grid spans the default "
                             "(world) process group")
        self.comm = comm
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self._topo = topology if topology is not None else default_topology(self.world_size)
        if self._topo.world_size() != self.world_size:
            raise ValueError(f"PipelineParallelGrid: the topology {self._topo} has {self._topo.world_size()} ranks but "
                             f"the world has {self.world_size} processes; the product of its dims must equal the "
                             "world size")
        for axis in ("pipe", "data"):
            if axis not in self._topo.axes:
                raise ValueError(f"PipelineParallelGrid: the topology needs a {axis!r} axis (axes: {self._topo.axes})")
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = coord.pipe
        self.data_parallel_id = coord.data
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

        self.groups = GroupCache(comm)
        # every rank creates every group, in this fixed order
        self.dp_groups = self._topo.get_axis_comm_lists("data")
        self.pipe_groups = self._topo.get_axis_comm_lists("pipe")
        self.model_groups = [self._topo.get_axis_list("data", d) for d in range(self.data_parallel_size)]
        self.slice_groups = self._topo.get_axis_comm_lists("model") if self.model_parallel_size > 1 else \
            [[r] for r in range(self.world_size)]
        self.dp_group = self.dp_proc_group = self.pp_group = self.pp_proc_group = None
        self.ds_model_ranks = self.ds_model_proc_group = self.slice_group = self.slice_proc_group = None
        for ranks in self.dp_groups:
            group = self.groups.get(ranks)
            if self.global_rank in ranks:
                self.dp_group, self.dp_proc_group = list(ranks), group
        for ranks in self.pipe_groups:
            group = self.groups.get(ranks)
            if self.global_rank in ranks:
                self.pp_group, self.pp_proc_group = list(ranks), group
        for ranks in self.model_groups:
            group = self.groups.get(ranks)
            if self.global_rank in ranks:
                self.ds_model_ranks, self.ds_model_proc_group = list(ranks), group
        for ranks in self.slice_groups:
            if len(ranks) > 1:
                group = self.groups.get(ranks)
            else:
                group = None  # one rank: nothing to communicate
            if self.global_rank in ranks:
                self.slice_group, self.slice_proc_group = list(ranks), group
        self.ds_model_rank = self.ds_model_ranks.index(self.global_rank)
        self.ds_model_world_size = len(self.ds_model_ranks)
        self.p2p_groups = self._p2p_pairs()

    def _p2p_pairs(self) -> List[List[int]]:
        """[rank, next-stage rank] for every stage boundary of every pipe group (wrapping around,
        as DeepSpeed lists them)."""
        pairs = []
        for ranks in self.pipe_groups:
            for i, r in enumerate(ranks):
                pairs.append([r, ranks[(i + 1) % len(ranks)]])
        return pairs

    # ------------------------------------------------------------------ coordinates
    def topology(self) -> ProcessTopology:
        return self._topo

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The global rank of stage ``stage_id`` with this rank's other coordinates (overridable by
        keyword, e.g. ``data=0``)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    def prev_stage_rank(self) -> Optional[int]:
        return None if self.is_first_stage else self.stage_to_global(self.stage_id - 1)

    def next_stage_rank(self) -> Optional[int]:
        return None if self.is_last_stage else self.stage_to_global(self.stage_id + 1)

    # ------------------------------------------------------------------ mpu interface (DeepSpeed's names)
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self.slice_proc_group
