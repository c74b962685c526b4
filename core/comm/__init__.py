"""The communication layer: every collective dsplug issues goes through these functions.

A thin layer over ``torch.distributed`` (gloo on CPU, NCCL on CUDA, chosen by the accelerator
plugin) so that logging, counting and backend gaps (gloo has no reduce-scatter) live in one place.
Every collective is reported through the ``dsplug_comm_op`` hook (:class:`dsplug.hookspecs.CommSpecs`)
to what is registered on :data:`events` (the comms logger, byte counters), with its size and
latency; while nothing is registered, no timing or device synchronization happens.

Every collective is bounded by the comm timeout (``comm_timeout_s`` / ``DSPLUG_COMM_TIMEOUT``):
a dead or stopped rank makes it raise :class:`CommError` naming that rank and the enclosing
:func:`operation` (see :mod:`dsplug.comm.faults`).
"""
from __future__ import annotations

import atexit
import os
import pickle
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import discovery, faults
from .faults import ENV_TIMEOUT, CommError, operation  # noqa: F401  (public: dsplug.comm.CommError, ...)
from .hooks import CommEvents

ReduceOp = dist.ReduceOp
#: the plugin manager of the comm hooks: register an object implementing ``dsplug_comm_op`` /
#: ``dsplug_comm_summary`` to see every collective (see :mod:`dsplug.comm.hooks`)
events = CommEvents()

#: the process group the collectives default to, as ``context.comm.group`` reads it: None here,
#: meaning torch.distributed's default group (the world). A :class:`dsplug.comm.bound.GroupComm`
#: (``context.comm`` with model parallelism) has its data-parallel ``ProcessGroup`` instead.
group = None


# ------------------------------------------------------------------------------ process group
def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout: Optional[timedelta] = None,
                     init_method: Optional[str] = None, dist_init_required: Optional[bool] = None, config=None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialise the default process group, like ``deepspeed.init_distributed``.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (and LOCAL_RANK) as torch's launcher sets
    them. With ``auto_mpi_discovery`` (the default), a process started by ``mpirun`` or ``srun``
    gets them from its launcher's variables first (:mod:`dsplug.comm.discovery`). With none of them
    set, a world of one process is created on 127.0.0.1.

    ``timeout`` (a timedelta or seconds; default ``DSPLUG_COMM_TIMEOUT`` seconds, else 30 minutes)
    bounds every collective. When the group already exists, a given ``timeout`` (or the variable)
    is applied to it.
    """
    wanted = faults.as_timedelta(timeout) or faults.env_timeout()
    if is_initialized():
        faults.record_peers()
        if wanted is not None and wanted != faults.timeout():
            set_timeout(wanted)
        return
    if dist_init_required is False:
        _no_group_wanted()
        return
    if auto_mpi_discovery:
        discovery.discover(port=distributed_port)
    from ..accelerator import get_accelerator

    backend = dist_backend or get_accelerator().communication_backend_name()
    env_rank = os.environ.get("RANK")
    env_world = os.environ.get("WORLD_SIZE")
    if rank < 0:
        rank = int(env_rank) if env_rank is not None else 0
    if world_size < 0:
        world_size = int(env_world) if env_world is not None else 1
    if init_method is None:
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise RuntimeError(
                    f"dsplug.init_distributed: WORLD_SIZE={world_size} but MASTER_ADDR / MASTER_PORT are not set; "
                    "start the processes with `dsplug launch` (or torchrun), or set them"
                )
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        else:
            init_method = "env://"
    if verbose and rank == 0:
        print(f"[dsplug] initializing process group: backend={backend} world_size={world_size}", flush=True)
    timeout = wanted or faults.DEFAULT_TIMEOUT
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    faults.created(timeout)
    faults.record_peers()
    _created_here["group"] = True  # destroyed at exit (_let_workers_finish_at_exit)
    accel = get_accelerator()
    if accel.device_count() > 1 or accel.name != "cpu":
        accel.set_device(int(os.environ.get("LOCAL_RANK", 0)) % max(1, accel.device_count()))


def _destroy_at_exit() -> None:
    """The group dsplug created is destroyed while Python still runs (torch asks for it before
    exit): left to interpreter teardown, the group and its store can be torn down out of order."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; a failed teardown must not mask the exit status
            pass


#: how long the interpreter, at exit, leaves the GIL to torch.distributed's worker threads
EXIT_GRACE_S = 0.05


def _let_workers_finish_at_exit() -> None:
    """Give torch.distributed's worker threads the GIL once more before the interpreter finalizes.

    A gloo worker thread drops its reference to a finished collective just after the waiting
    thread has been woken; when that is the last reference to a tensor created in Python, freeing
    it needs the GIL. If the main thread holds the GIL from there until finalization, the worker
    is still waiting for it when Python finalizes, Python ends the thread inside a C++ destructor,
    and the process aborts ("terminate called without an active exception", exit status 134;
    seen in ~10 % of 2-process runs here, whichever framework created the group). Sleeping hands
    the GIL over: a worker finishes in microseconds. Also after :func:`destroy_process_group`
    (``dsplug train`` destroys its group before it returns): seen once in a suite run, on the
    rank with nothing left to do after its last collective."""
    if not dist.is_available():
        return
    if dist.is_initialized() or _created_here["destroyed"]:
        time.sleep(EXIT_GRACE_S)
    if dist.is_initialized() and _created_here["group"]:
        _destroy_at_exit()


#: whether init_distributed created the default group; whether destroy_process_group destroyed one
_created_here = {"group": False, "destroyed": False}
atexit.register(_let_workers_finish_at_exit)  # at import: also for a group another framework created


def planned_world_size(dist_init_required: Optional[bool] = None) -> int:
    """The world size :func:`init_distributed` will create (or the existing group's)."""
    if is_initialized():
        return get_world_size()
    if dist_init_required is False:
        _no_group_wanted()
        return 1
    discovery.discover()
    return int(os.environ.get("WORLD_SIZE", 1))


def _no_group_wanted() -> None:
    """``dist_init_required=False`` with no process group: a process alone trains as a world of
    one; one of several (``WORLD_SIZE`` > 1) would silently train alone, so it is refused (as
    DeepSpeed refuses it, which never runs without a group)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip().isdigit() and int(world) > 1:
        raise ValueError(f"dist_init_required=False, but torch.distributed has no process group and this process "
                         f"is rank {os.environ.get('RANK', '?')} of WORLD_SIZE={world}: create the group first "
                         "(torch.distributed.init_process_group), or leave dist_init_required unset (None) so "
                         "that dsplug creates it")


def get_timeout() -> timedelta:
    """The bound of every collective on the default group."""
    return faults.timeout()


def set_timeout(timeout) -> None:
    """Bound every collective of the existing default group by ``timeout`` (timedelta or seconds)."""
    timeout = faults.as_timedelta(timeout)
    try:
        faults.set_timeout(timeout)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot change it: say so, keep going
        from ..logging import logger

        logger.warning(f"dsplug.comm: could not set the comm timeout to {faults.seconds(timeout)} s on the "
                       f"{get_backend()} process group ({type(exc).__name__}: {exc}); it keeps {get_timeout()}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_backend(group=None) -> str:
    return dist.get_backend(group) if is_initialized() else "none"


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()
        _created_here["destroyed"] = True  # its worker threads still get the GIL at exit
    faults.forget()


# ------------------------------------------------------------------------------ comm hooks
def log_summary(show_straggler: bool = False) -> None:
    """Print the summaries of what is registered on :data:`events` (``dsplug_comm_summary``: the
    comms logger's table).

    ``show_straggler`` is passed on; it makes the comms logger gather latencies from every rank,
    so then every rank must call this.
    """
    answers = events.hook.dsplug_comm_summary(show_straggler=show_straggler)
    if not answers:
        print("dsplug.comm.log_summary: no comms logger is active (enable the comms_logger config section)")


class _Work:
    """A finished-or-pending collective whose ``wait()`` also reports it (``dsplug_comm_op``)."""

    def __init__(self, work, op: str, nbytes: int, start: float, world: int, caller: Optional[str] = None,
                 gloo: bool = False):
        self.work, self.op, self.nbytes, self.start, self.world = work, op, nbytes, start, world
        self.caller = caller
        self.gloo = gloo
        self.reported = False

    def wait(self):
        if self.work is not None:
            if not self.work.is_completed():
                faults.check_usable(self.op)
            try:
                faults.bounded_wait(self.work, self.gloo)
            except RuntimeError as exc:
                _raise_failure(self.op, self.start, exc)
        if self.reported:
            return True
        self.reported = True
        if self.world > 1 or is_initialized():  # a world of one without a group issued nothing
            _report(self.op, self.nbytes, self.start, self.world, async_op=True, caller=self.caller)
        return True

    def is_completed(self):
        return self.work is None or self.work.is_completed()


def _report(op: str, nbytes: int, start: float, world: int, async_op: bool = False,
            caller: Optional[str] = None) -> None:
    if not events.watching:
        return
    _synchronize()
    latency = time.perf_counter() - start
    events.hook.dsplug_comm_op(op=op, nbytes=nbytes, latency_s=latency, world_size=world, async_op=async_op,
                               caller=caller)


def _synchronize() -> None:
    """Wait for the device, so that a timed op has really finished (no-op on CPU)."""
    from ..accelerator import get_accelerator

    get_accelerator().synchronize()


#: the comm layer's own files: the issuing function is the first frame outside them
_OWN_FILES = frozenset({__file__, os.path.join(os.path.dirname(__file__), "bound.py"),
                        os.path.join(os.path.dirname(__file__), "deepspeed_compat.py")})


def _caller() -> Optional[str]:
    """The function outside the comm layer that issued the current op (only while a ``dsplug_comm_op``
    implementation takes ``caller``): the comm layer's own frames (this module, a
    :class:`~dsplug.comm.bound.GroupComm`, DeepSpeed's spellings) are skipped."""
    if not events.wants_caller:
        return None
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _OWN_FILES:
        frame = frame.f_back
    if frame is None:
        return None
    return getattr(frame.f_code, "co_qualname", frame.f_code.co_name)


def _raise_failure(op: str, start: float, exc: BaseException):
    """Re-raise ``exc`` from torch.distributed: as a CommError naming the dead rank when it is one."""
    error = faults.failure(op, start, exc)
    if error is exc:
        raise exc
    raise error from exc


def _guarded(op: str, fn: Callable):
    """Run ``fn`` (collectives issued straight to torch.distributed) with the failure diagnosis."""
    faults.check_usable(op)
    start = time.perf_counter()
    try:
        return fn()
    except RuntimeError as exc:
        _raise_failure(op, start, exc)


def _run(op: str, tensor_bytes: int, fn: Callable, async_op: bool, group):
    world = get_world_size(group)
    if world == 1 and not is_initialized():
        return _Work(None, op, tensor_bytes, time.perf_counter(), 1) if async_op else None
    faults.check_usable(op)
    watching = events.watching
    caller = _caller() if watching else None
    if watching:
        _synchronize()
    start = time.perf_counter()
    try:
        work = fn()
    except RuntimeError as exc:
        _raise_failure(op, start, exc)
    if async_op:
        return _Work(work, op, tensor_bytes, start, world, caller, gloo=get_backend(group) == "gloo")
    if watching:
        _report(op, tensor_bytes, start, world, caller=caller)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------------------ collectives
def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _run("all_reduce", _nbytes(tensor), lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
                async_op, group)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    return _run("broadcast", _nbytes(tensor), lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
                async_op, group)


class _AllWorks:
    """Several pending works that finish together; ``after`` (if given) runs once when they have."""

    def __init__(self, works, after: Optional[Callable[[], None]] = None, gloo: bool = True):
        self.works = [w for w in works if w is not None]
        self.after = after
        self.gloo = gloo

    def wait(self, timeout=None):
        for w in self.works:
            faults.bounded_wait(w, gloo=self.gloo)
        if self.after is not None:
            after, self.after = self.after, None
            after()
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


def _gloo_gather_by_broadcasts(chunks, tensor, group, async_op):
    """gloo's all-gather is several times slower than one broadcast per rank of the same bytes
    (measured on CPU), so on gloo an all-gather is issued as those broadcasts."""
    rank = get_rank(group)
    chunks[rank].copy_(tensor)
    works = []
    for r, chunk in enumerate(chunks):
        src = r if group is None else dist.get_global_rank(group, r)
        works.append(dist.broadcast(chunk, src=src, group=group, async_op=True))
    if async_op:
        return _AllWorks(works)
    _AllWorks(works).wait()
    return None


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather equal-sized ``input`` from every rank into ``output`` (rank-major)."""
    def fn():
        if get_backend(group) == "gloo" and output.is_contiguous():
            return _gloo_gather_by_broadcasts(list(output.view(-1).chunk(get_world_size(group))),
                                              input.reshape(-1), group, async_op)
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)

    return _run("all_gather", _nbytes(output), fn, async_op, group)


def all_gather(tensor_list, tensor: torch.Tensor, group=None, async_op: bool = False):
    def fn():
        if get_backend(group) == "gloo" and all(t.is_contiguous() for t in tensor_list):
            return _gloo_gather_by_broadcasts(tensor_list, tensor, group, async_op)
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)

    return _run("all_gather", _nbytes(tensor) * len(tensor_list), fn, async_op, group)


_RING_SCRATCH: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}
_RING_LOCK = threading.Lock()


def _ring_scratch(like: torch.Tensor) -> torch.Tensor:
    """A receive buffer shaped like ``like``, kept between calls: a large fresh allocation is
    page-faulted in on every call (measured: 59 ms for 100 MB, three times the ring's own add)."""
    key = (like.dtype, like.device)
    held = _RING_SCRATCH.get(key)
    if held is None or held.numel() < like.numel():
        held = _RING_SCRATCH[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
    return held[:like.numel()].view_as(like)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of ``a`` and ``b`` overlaps (contiguous tensors)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and \
        a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _gloo_ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """A ring reduce-scatter (sum) over point-to-point messages, for gloo, which has no
    reduce-scatter: in world-1 steps each rank sends one running partial sum of a 1/world slice to
    its right neighbour and adds the one arriving from its left, so each rank sends (n-1)/n of
    ``input`` -- half of what an all-reduce moves -- and ends with its own slice summed over every
    rank. ``input`` is only read (an ``output`` inside it is filled at the end). The partial sums
    alternate between ``output`` and one scratch buffer kept by this module (world > 2 only):
    nothing large is allocated per call. (Measured on loopback gloo, 200 MB at 2 ranks: 86 ms, vs
    209 ms for an all-reduce of the same bytes.)

    ``async_op`` with an even world: the first step (all of it at 2 ranks) is left in flight and a
    work is returned whose ``wait()`` finishes it and runs the other steps; ``input`` and
    ``output`` must stay untouched until then. Otherwise the ring finishes before returning (None)."""
    world, rank = get_world_size(group), get_rank(group)
    rows = input.reshape(world, -1)
    out = output.view(-1)
    if world == 1:
        out.copy_(rows[0])
        return None
    if _overlap(out, input):  # in place (output a slice of input): partial sums may not land there
        result = torch.empty_like(out)
        _gloo_ring_reduce_scatter(result, input, group)
        out.copy_(result)
        return None
    right, left = _global_rank(group, (rank + 1) % world), _global_rank(group, (rank - 1) % world)

    def run_steps(first: int, partial: torch.Tensor) -> None:
        # step s receives into buffers[s % 2]; the last step (world - 2) must land in ``output``
        scratch = _ring_scratch(out) if world > 2 else None
        buffers = (out, scratch) if world % 2 == 0 else (scratch, out)
        for step in range(first, world - 1):
            arriving = buffers[step % 2]
            works = [dist.isend(partial, right, group=group), dist.irecv(arriving, left, group=group)]
            for work in works:
                faults.bounded_wait(work, gloo=True)
            partial = arriving.add_(rows[(rank - 2 - step) % world])

    if async_op and world % 2 == 0:
        # step 0 receives into ``output`` (not the shared scratch), so it may stay in flight while
        # other reductions start; every rank issues them in the same order, so messages pair up
        works = [dist.isend(rows[(rank - 1) % world], right, group=group), dist.irecv(out, left, group=group)]

        def after_first_step() -> None:
            partial = out.add_(rows[(rank - 2) % world])
            if world > 2:
                with _RING_LOCK:
                    run_steps(1, partial)

        return _AllWorks(works, after=after_first_step)
    with _RING_LOCK:
        run_steps(0, rows[(rank - 1) % world])  # (the first partial is only read (sent): no copy)
    return None


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Reduce ``input`` over ranks and leave rank r's equal slice in ``output``.

    gloo has no reduce-scatter: there a sum is a ring reduce-scatter over point-to-point messages
    (:func:`_gloo_ring_reduce_scatter`, asynchronous with ``async_op`` where the world is even);
    another op is an all-reduce of ``input`` (in place) followed by a copy of this rank's slice
    (reported as op ``"all_reduce"``), which finishes before returning (None) even with ``async_op``.
    """
    gloo = get_backend(group) == "gloo"
    if gloo and op != ReduceOp.SUM:
        def fallback():
            dist.all_reduce(input, op=op, group=group)
            output.copy_(input.chunk(get_world_size(group))[get_rank(group)])

        return _run("all_reduce", _nbytes(input), fallback, False, group)

    def fn():
        if gloo:
            return _gloo_ring_reduce_scatter(output, input, group, async_op=async_op)
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)

    return _run("reduce_scatter", _nbytes(input), fn, async_op, group)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _run("reduce", _nbytes(tensor), lambda: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op),
                async_op, group)


def barrier(group=None) -> None:
    _run("barrier", 0, lambda: dist.barrier(group=group), False, group)


def _object_device(group):
    if get_backend(group) == "gloo":
        return torch.device("cpu")
    from ..accelerator import get_accelerator

    accel = get_accelerator()
    return accel.device(accel.current_device())


def _pickled(obj, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _unpickled(tensor: torch.Tensor, size: int):
    # bytes(list) rather than tensor.numpy(): torch's own object collectives need numpy, which a
    # plain `pip install torch` does not bring
    return pickle.loads(bytes(tensor[:size].cpu().tolist()))


def all_gather_object(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable), in rank order."""
    world = get_world_size(group)
    if world == 1:
        return [obj]
    device = _object_device(group)
    payload = _pickled(obj, device)
    size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    _guarded("all_gather", lambda: dist.all_gather(sizes, size, group=group))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    chunks = [torch.empty_like(padded) for _ in range(world)]
    _guarded("all_gather", lambda: dist.all_gather(chunks, padded, group=group))
    return [_unpickled(chunk, int(n)) for chunk, n in zip(chunks, sizes)]


def broadcast_object(obj, src: int = 0, group=None):
    """``src``'s ``obj`` on every rank."""
    if get_world_size(group) == 1:
        return obj
    device = _object_device(group)
    payload = _pickled(obj, device) if get_rank() == src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.long, device=device)
    _guarded("broadcast", lambda: dist.broadcast(size, src=src, group=group))
    if payload is None:
        payload = torch.empty(int(size), dtype=torch.uint8, device=device)
    _guarded("broadcast", lambda: dist.broadcast(payload, src=src, group=group))
    return _unpickled(payload, int(size))


# DeepSpeed's deepspeed.comm names that scripts and Hugging Face / Accelerate call besides the above
from .deepspeed_compat import *  # noqa: E402,F401,F403


# ------------------------------------------------------------------------------ point-to-point, all-to-all
def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking). Reported as op ``"send"`` with the
    tensor's bytes."""
    _run("send", _nbytes(tensor), lambda: dist.send(tensor, dst=dst, group=group, tag=tag), False, group)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank when None); returns the sender's
    rank, like torch. Reported as op ``"recv"`` with the tensor's bytes (the message size)."""
    sender = [src if src is not None else -1]

    def fn():
        sender[0] = dist.recv(tensor, src=src, group=group, tag=tag)

    _run("recv", _nbytes(tensor), fn, False, group)
    return sender[0]


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    """Asynchronous :func:`send`: returns a work handle whose ``wait()`` finishes it (and reports
    op ``"send"``, flagged async)."""
    return _run("send", _nbytes(tensor), lambda: dist.isend(tensor, dst=dst, group=group, tag=tag), True, group)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0):
    """Asynchronous :func:`recv`: returns a work handle; ``tensor`` holds the message after ``wait()``."""
    return _run("recv", _nbytes(tensor), lambda: dist.irecv(tensor, src=src, group=group, tag=tag), True, group)


#: backends whose process groups turned out to lack all-to-all: there it is point-to-point messages
_NO_NATIVE_ALL_TO_ALL = set()
#: the tag of the fallback's messages, apart from a user's point-to-point traffic (tag 0 by default)
_ALL_TO_ALL_TAG = 0x0A2A


def _unsupported(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("does not support", "not supported", "not implemented"))


def _native_or_p2p(native: Callable, p2p: Callable, group):
    """``native()`` (torch's all-to-all) unless the backend lacks it, else ``p2p()``.

    A backend without all-to-all refuses it locally, before any message, on every rank alike, so
    falling back then is safe; the backend is remembered and later calls go straight to ``p2p``.
    """
    backend = get_backend(group)
    if backend not in _NO_NATIVE_ALL_TO_ALL:
        try:
            return native()
        except (RuntimeError, NotImplementedError) as exc:
            if not _unsupported(exc):
                raise
            _NO_NATIVE_ALL_TO_ALL.add(backend)
    return p2p()


def _p2p_all_to_all(outputs, inputs, group, async_op: bool):
    """All-to-all as one isend/irecv pair per other rank plus a local copy: ``inputs[r]`` goes to
    group rank r, ``outputs[r]`` receives group rank r's message. Contiguous tensors are sent and
    received in place; others go through contiguous copies."""
    rank, world = get_rank(group), get_world_size(group)
    sends = [t if t.is_contiguous() else t.contiguous() for t in inputs]
    recvs = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format) for t in outputs]
    works = []
    for offset in range(1, world):  # a ring order: every rank talks to rank + k while rank - k talks to it
        dst, src = (rank + offset) % world, (rank - offset) % world
        if sends[dst].numel():
            works.append(dist.isend(sends[dst], dst=_global_rank(group, dst), group=group, tag=_ALL_TO_ALL_TAG))
        if recvs[src].numel():
            works.append(dist.irecv(recvs[src], src=_global_rank(group, src), group=group, tag=_ALL_TO_ALL_TAG))
    recvs[rank].copy_(sends[rank])

    def after():
        for out, got in zip(outputs, recvs):
            if out is not got:
                out.copy_(got)

    pending = _AllWorks(works, after, gloo=get_backend(group) == "gloo")
    if async_op:
        return pending
    pending.wait()
    return None


def _global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _splits(name: str, sizes, rows: int, world: int) -> List[int]:
    if sizes is None or len(sizes) == 0:
        if rows % world:
            raise ValueError(f"all_to_all_single: {name} has {rows} rows along dim 0, not divisible by the "
                             f"{world} ranks; give {name}_split_sizes")
        return [rows // world] * world
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(f"all_to_all_single: {name}_split_sizes {sizes} must be {world} non-negative sizes "
                         f"summing to the {rows} rows of {name} along dim 0")
    return sizes


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False):
    """torch.distributed.all_to_all_single: split ``input`` along dim 0 into one chunk per rank
    (``input_split_sizes`` rows each, equal when None) and send chunk r to rank r; ``output``
    receives rank r's chunk for this rank at its r-th split (``output_split_sizes``).

    Uses the backend's all-to-all (NCCL, MPI and recent torch's gloo have it); a backend without
    one gets an isend/irecv pair per other rank plus a local copy of the own chunk, same result.

    Reported as op ``"all_to_all_single"`` with nbytes = the bytes of ``input`` (the message
    size, like the whole output of an all-gather and the whole input of a reduce-scatter; the
    bus factor (n - 1) / n of the comms logger turns it into what goes to other ranks when the
    splits are equal).
    """
    world = get_world_size(group)
    in_splits = _splits("input", input_split_sizes, input.size(0) if input.dim() else 0, world)
    out_splits = _splits("output", output_split_sizes, output.size(0) if output.dim() else 0, world)
    if world == 1 and not is_initialized():
        output.copy_(input)

    def native():
        return dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                      input_split_sizes=input_split_sizes, group=group, async_op=async_op)

    def p2p():
        return _p2p_all_to_all(list(output.split(out_splits)), list(input.split(in_splits)), group, async_op)

    return _run("all_to_all_single", _nbytes(input), lambda: _native_or_p2p(native, p2p, group), async_op, group)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """torch.distributed.all_to_all: ``input_tensor_list[r]`` goes to rank r and
    ``output_tensor_list[r]`` receives rank r's tensor for this rank; the tensors may differ in
    shape (natively where the backend can; gloo's all-to-all takes one shape only, so other lists
    go as point-to-point messages, as in :func:`all_to_all_single` on a backend without one).

    Reported as op ``"all_to_all"`` with nbytes = the bytes of all of ``input_tensor_list``."""
    world = get_world_size(group)
    if len(output_tensor_list) != world or len(input_tensor_list) != world:
        raise ValueError(f"all_to_all: expected {world} output and input tensors (one per rank), got "
                         f"{len(output_tensor_list)} and {len(input_tensor_list)}")
    if world == 1 and not is_initialized():
        output_tensor_list[0].copy_(input_tensor_list[0])

    def native():
        return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)

    def p2p():
        return _p2p_all_to_all(list(output_tensor_list), list(input_tensor_list), group, async_op)

    def fn():
        shapes = {tuple(t.shape) for t in (*output_tensor_list, *input_tensor_list)}
        if len(shapes) > 1 and get_backend(group) == "gloo":  # gloo's all-to-all wants one shape for all
            return p2p()
        return _native_or_p2p(native, p2p, group)

    return _run("all_to_all", sum(_nbytes(t) for t in input_tensor_list), fn, async_op, group)
