"""ZeRO stages 1 and 2: optimizer states (and fp32 master weights), then gradients, partitioned.

Layout (:mod:`.partition`): each param group is one flat buffer in the model dtype; the module's
parameters are views into it; rank r owns the slice ``[r*P, (r+1)*P)``. Each rank keeps only its
slice of the fp32 master weights (fp16/bf16; in fp32 the optimizer steps the slice of the buffer
itself) and of the optimizer state, and the optimizer sees one flat tensor per group.

Gradients (:mod:`.reducer`): averaged over ranks in buckets of ``reduce_bucket_size`` elements and
added into their owner's gradient partition (in the accumulation dtype).

* stage 1: gradients accumulate whole, locally, over the micro-steps; they are reduced during the
  backward pass of the last micro-step (from the gradient hooks; with ``grad_hooks=false`` after
  that backward pass) and then released.
* stage 2: every micro-step's gradients are reduced as backward produces them, so between
  micro-steps only this rank's gradient partition is kept.

Step: the partition gradients become the fp32 master gradients, are unscaled (fp16), the global
norm is summed over ranks (overflow check, clipping), the optimizer steps the local slice, the
slice is written back in the model dtype and the slices are all-gathered (``allgather_bucket_size``
elements at a time) or, with ``allgather_partitions=false`` or the top-level ``disable_allgather``,
broadcast from their owners.

Checkpoints follow the ``contiguous`` layout of ``docs/zero-stages.md``; a checkpoint saved with
another world size (or the ``per_param`` layout of stage 3) is merged and re-sliced on load.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import attrs
import torch

from dsplug.checkpoint import CheckpointError
from dsplug.contracts import ZeroStage

from ..checkpoint import deepspeed_format as dsf
from ..checkpoint.layout import merge_partitions
from ..partitioning.checks import check_elementwise
from ..partitioning.flat import FlatGroup, gather_partitions, round_robin_order
from ..partitioning.gradients import comm_dtype, fp32_clip_coefficient, fp64_square_sum, unscale_check_clip
from ..partitioning.offload import open_devices
from ..partitioning.reductions import reduction_domains
from .traits import TRAITS
from .reducer import FlatGradientReducer, ReducerSet


@attrs.define(frozen=True)
class Domain:
    """Where a param group is partitioned and reduced (``context.reduction_of`` of its
    parameters): ``name`` None = the data-parallel group, else the key of the group a plugin
    averages them in; ``comm`` bound to it; the sums divided by ``divisor``."""

    name: Optional[str]
    comm: object
    rank: int
    world_size: int
    divisor: int = 1
    what: str = "parameters"


def _domain_of(group: dict, gi: int, names, stage) -> Domain:
    domains = reduction_domains(list(group["params"]), stage.context.reduction_of)
    if len(domains) > 1:
        other = next(r for key, (r, _ps) in domains.items() if key is not None)
        listed = [names[p] for key, (_r, ps) in domains.items() if key is not None for p in ps]
        raise ValueError(f"ZeRO stage {stage.stage}: param group {gi} mixes {other.what} ({', '.join(listed[:3])}"
                         f"{' ...' if len(listed) > 3 else ''}) with parameters averaged elsewhere; give the optimizer "
                         f"separate groups{f' ({other.advice})' if other.advice else ''}")
    (name, (reduction, _params)), = domains.items()
    if name is None:
        return Domain(None, stage.comm, stage.rank, stage.world_size, reduction.divisor)
    bound = reduction.comm
    return Domain(name, bound, bound.get_rank(), bound.get_world_size(), reduction.divisor, reduction.what)


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class PartitionedStage(dsf.DeepSpeedInterchange, ZeroStage):
    def __init__(self, stage: int, module: torch.nn.Module, param_groups: List[dict], build_optimizer, precision,
                 zero_config, kernel_config, context):
        if stage not in (1, 2):
            raise ValueError(f"PartitionedStage implements ZeRO stages 1 and 2, not {stage}")
        self.stage = stage
        self.traits = TRAITS[stage]
        self.module = module
        self.precision = precision
        self.context = context
        self.comm = context.comm
        self.world_size, self.rank = context.world_size, context.rank
        self.zero_config = zero_config
        self.clip = float(kernel_config.gradient_clipping or 0.0)
        _refuse_unimplemented(zero_config, stage)
        self.ignore_unused = bool(getattr(zero_config, "ignore_unused_parameters", True))
        self.load_from_fp32_weights = bool(getattr(zero_config, "load_from_fp32_weights", True))
        self.grad_hooks = stage == 2 or bool(getattr(zero_config, "grad_hooks", True))
        self.use_broadcast = bool(kernel_config.disable_allgather) or \
            not bool(getattr(zero_config, "allgather_partitions", True))
        self.allgather_elements = int(getattr(zero_config, "allgather_bucket_size", 5 * 10 ** 8))

        names = {p: n for n, p in module.named_parameters()}
        _check_groups(param_groups, names, stage)
        #: per param group: where it is partitioned (the data-parallel group, or the group a plugin
        #: averages its parameters in: see plugins/zero/partitioning/reductions.py)
        self.domains: List[Domain] = [_domain_of(g, gi, names, self) for gi, g in enumerate(param_groups)]
        self.groups: List[FlatGroup] = []
        for gi, (g, domain) in enumerate(zip(param_groups, self.domains)):
            params = list(g["params"])
            if getattr(zero_config, "round_robin_gradients", False):
                params = round_robin_order(params, domain.world_size)
            self.groups.append(FlatGroup(gi, params, [names[p] for p in params], domain.world_size, domain.rank,
                                         precision.model_dtype, params[0].device))
        self.params = [p for g in self.groups for p in g.params]

        #: offload_optimizer: the master partitions and optimizer state in the offload device (None: kept here)
        self.offload = _offload_master(zero_config, context, stage)
        if self.offload is not None:
            self.opt_params = [self.offload.master_of(gi, g.local) for gi, g in enumerate(self.groups)]
        elif precision.master_weights:
            self.opt_params = [g.local.detach().to(torch.float32).clone() for g in self.groups]
        else:
            self.opt_params = [g.local for g in self.groups]  # the optimizer steps the buffer itself
        #: the optimizer steps a copy of the partition (not the model's buffer itself)
        self.separate_master = self.offload is not None or precision.master_weights
        # the optimizer sees each partition as views of at most OPTIMIZER_CHUNK elements
        self.chunks = [_chunk_views(t) for t in self.opt_params]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        build = self.offload.build_optimizer if self.offload is not None else \
            (lambda groups, builder: builder(groups))
        self.optimizer = build([{**h, "params": c} for h, c in zip(hyper, self.chunks)], build_optimizer)
        if self.optimizer is not None:
            check_elementwise(self.optimizer, stage, bool(kernel_config.zero_allow_untested_optimizer))

        self.accum_dtype = precision.grad_accum_dtype or precision.model_dtype
        self.partition_grads: List[Optional[torch.Tensor]] = [None] * len(self.groups)
        self.accumulators: Dict[torch.nn.Parameter, torch.Tensor] = {}
        self._trainable = set(self.params)
        backward_order = [p for p in reversed(list(module.parameters())) if p in self._trainable]
        reducers = []
        for domain, groups in self._by_domain():
            members = {p for g in groups for p in g.params}
            reducers.append(FlatGradientReducer(
                groups, [p for p in backward_order if p in members],
                max(1, int(getattr(zero_config, "reduce_bucket_size", 5 * 10 ** 8))),
                domain.comm, domain.rank, domain.world_size, comm_dtype(kernel_config, self.accum_dtype),
                self.groups[0].buffer.device, prescale=kernel_config.prescale_gradients,
                predivide=kernel_config.gradient_predivide_factor,
                reduce_scatter=bool(getattr(zero_config, "reduce_scatter", True)),
                overlap=bool(getattr(zero_config, "overlap_comm", False)),
                contiguous=bool(getattr(zero_config, "contiguous_gradients", True)),
                grad_of=self._grad_of, release=self._release, deliver=self._deliver, divisor=domain.divisor))
        self.reducer = reducers[0] if len(reducers) == 1 else ReducerSet(reducers)
        self._boundary = True
        self._unreduced = False  # stage 1: accumulated gradients not reduced yet
        self._accumulating = False  # the gradient partitions hold a backward pass's values
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.last_grad_norm: Optional[float] = None

    def _by_domain(self):
        """[(domain, its flat groups)] in first-appearance order (the data-parallel one first)."""
        out: Dict[Optional[str], tuple] = {}
        for domain, group in zip(self.domains, self.groups):
            out.setdefault(domain.name, (domain, []))[1].append(group)
        return list(out.values())

    # ------------------------------------------------------------------ backward
    def _grad_of(self, p) -> Optional[torch.Tensor]:
        if p.dtype != self.accum_dtype and self.stage == 1:
            return self.accumulators.get(p)
        return p.grad

    def _release(self, p) -> None:
        p.grad = None
        self.accumulators.pop(p, None)

    def _deliver(self, gi: int, start: int, values: torch.Tensor) -> None:
        """Put reduced gradient values into this rank's partition: every element of the partition
        (padding aside) is delivered exactly once per backward pass, so the first pass after a
        step overwrites and later ones accumulate; no zeroing pass is needed."""
        part = self.partition_grads[gi]
        if part is None:
            group = self.groups[gi]
            part = self.partition_grads[gi] = torch.empty(group.partition_numel, dtype=self.accum_dtype,
                                                          device=values.device)
            part[max(0, group.numel - group.rank * group.partition_numel):].zero_()  # padding
        target = part[start:start + values.numel()]
        if self._accumulating:
            target.add_(values)
        else:
            target.copy_(values)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self.stage == 1:
            if p.dtype != self.accum_dtype:
                acc = self.accumulators.get(p)
                if acc is None:
                    self.accumulators[p] = p.grad.detach().to(self.accum_dtype)
                else:
                    acc.add_(p.grad.detach())
                p.grad = None
            self._unreduced = True
            if not (self._boundary and self.grad_hooks):
                return
        self.reducer.on_grad(p)

    def before_backward(self, is_boundary: bool) -> None:
        self._boundary = is_boundary

    def after_backward(self) -> None:
        if self.stage == 2 or self._boundary:
            self._reduce_round()

    def _reduce_round(self) -> None:
        if self.stage == 1:
            for p in self.reducer.backward_params():
                if self._grad_of(p) is not None:
                    self.reducer.on_grad(p)  # no-op for gradients the hooks already handed over
        missing = set(self.reducer.missing())
        if missing and not self.ignore_unused:
            names = [n for g in self.groups for p, n in zip(g.params, g.names) if p in missing]
            self.reducer.start_round()
            raise RuntimeError(
                f"ZeRO stage {self.stage}: {len(names)} parameter(s) received no gradient in this backward pass: "
                f"{', '.join(names[:10])}{' ...' if len(names) > 10 else ''}. Set "
                "zero_optimization.ignore_unused_parameters=true to treat them as zero gradients, or leave them "
                "out of the optimizer (requires_grad=False)")
        self.reducer.finish_round()
        self._unreduced = False
        self._accumulating = True

    # ------------------------------------------------------------------ step
    def step(self) -> bool:
        """Apply one optimizer step; return False if an overflow skipped it."""
        if self._unreduced:  # stage 1 after a backward that did not reduce (allreduce_gradients=False)
            self._reduce_round()
        grads = []
        for gi, (group, target) in enumerate(zip(self.groups, self.opt_params)):
            part = self.partition_grads[gi] if self._accumulating else None  # None: no backward since the last step
            if part is None:
                part = torch.zeros(group.partition_numel, dtype=self.accum_dtype, device=target.device)
            if self.offload is not None:
                grad = self.offload.host_grad(gi, part)
            else:
                grad = part if part.dtype == target.dtype else part.to(target.dtype)
            for chunk, view in zip(self.chunks[gi], _chunk_views(grad)):
                chunk.grad = view
            grads.append(grad)
        apply, self.last_grad_norm = unscale_check_clip(grads, self.precision, self.clip, self._global_norm,
                                                        coefficient=fp32_clip_coefficient)
        if not apply:
            self.zero_grad()
            return False
        if self.offload is not None:  # the CPU step may also write 16-bit host partitions itself
            written = self.offload.step(self.optimizer, [_chunk_views(g.local) for g in self.groups])
        else:
            self.optimizer.step()
            written = False
        with torch.no_grad():
            if self.separate_master and not written:
                for group, master in zip(self.groups, self.opt_params):
                    group.local.copy_(master)
            for domain, groups in self._by_domain():
                if domain.world_size > 1:
                    gather_partitions(groups, domain.comm, self.allgather_elements, self.use_broadcast)
        self.zero_grad()
        return True

    def _global_norm(self, grads: List[torch.Tensor]) -> float:
        """The norm over every rank's partitions (one per param group), in DeepSpeed's precision:
        each group's sum of squares in fp64, rounded to fp32, summed over the ranks; the group
        norms (fp32) then combined. The rounding matches DeepSpeed's to the last bit, which bf16
        training magnifies (a weight that rounds the other way)."""
        squares = torch.stack([fp64_square_sum(g) for g in grads]).float()
        if self.world_size > 1:
            squares = squares.to(self.groups[0].buffer.device)
            self.comm.all_reduce(squares)
        total = float(torch.linalg.vector_norm(squares.sqrt(), 2))
        return total if math.isfinite(total) else float("nan") if math.isnan(total) else float("inf")

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for chunk in (c for chunks in self.chunks for c in chunks):
            chunk.grad = None
        self.accumulators.clear()
        self._accumulating = False  # the next backward pass overwrites the gradient partitions
        if self.stage == 1:  # stage 2 keeps its gradient partition (reused every step)
            self.partition_grads = [None] * len(self.groups)
        self.reducer.start_round()
        self._unreduced = False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        groups = []
        for gi, (group, target) in enumerate(zip(self.groups, self.opt_params)):
            state = self._joined_state(gi)
            hyper = {k: v for k, v in self.optimizer.param_groups[gi].items() if k != "params"}
            fp32 = target.detach().clone() if not self.precision.master_weights else target.detach()
            groups.append({**group.describe(), "fp32": fp32.to(torch.float32), "state": state, "hyper": hyper})
        return {"zero_stage": self.stage, "layout": "contiguous", "world_size": self.world_size, "rank": self.rank,
                "groups": groups}

    def _joined_state(self, gi: int) -> dict:
        """Group ``gi``'s optimizer state over its whole partition: element-wise state concatenated
        over the chunks; per-group values (the same in every chunk) from the first: scalars, and
        one-element tensors that are not element-wise (a step counter kept as a tensor of shape (1,))."""
        partition = self.groups[gi].partition_numel
        per_chunk = [self.optimizer.state.get(c, {}) for c in self.chunks[gi]]
        state = {}
        for key, value in per_chunk[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                parts = [s[key] for s in per_chunk]
                if any(p.shape != c.shape for p, c in zip(parts, self.chunks[gi])):
                    if all(p.numel() == 1 for p in parts):
                        state[key] = value
                        continue
                    raise RuntimeError(f"optimizer state {key!r} of group {gi} is neither a scalar nor element-wise "
                                       f"(shape {tuple(value.shape)} for a slice of {self.chunks[gi][0].numel()})")
                state[key] = torch.cat(parts) if len(parts) > 1 else parts[0]
                assert state[key].numel() == partition
            else:
                state[key] = value
        return state

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True, saved_world_size=None,
                        read_rank=None) -> None:
        if not isinstance(state, dict) or "layout" not in state:
            saved = state.get("zero_stage", 0) if isinstance(state, dict) else "?"
            raise CheckpointError(
                f"ZeRO stage {self.stage} cannot load this checkpoint's optimizer state: it was saved without "
                f"partitions (ZeRO stage {saved}). Load it with load_module_only=True (weights only, fresh optimizer), "
                "or at the stage it was saved with")
        if self._same_partitioning(state):
            slices = [self._slice_of_saved_group(g) for g in state["groups"]]
        else:
            other = next((d for d in self.domains if d.name is not None), None)
            if other is not None:
                raise CheckpointError(f"the checkpoint was saved by {state['world_size']} data-parallel ranks and this "
                                      f"run has {self.world_size}; ZeRO stage {self.stage} partitions of {other.what} "
                                      f"(averaged in the group {other.name!r}) reload at the same data-parallel world "
                                      "size only (or pass load_module_only=True for the weights)")
            if read_rank is None:
                raise CheckpointError(f"the checkpoint was saved with {state['world_size']} ranks ({state['layout']} "
                                      f"layout); re-slicing it for {self.world_size} needs every rank's file")
            world = int(saved_world_size or state["world_size"])
            merged = merge_partitions([read_rank(r) for r in range(world)], where="optimizer states")
            slices = [self._slice_of_merged_group(gi, m) for gi, m in enumerate(self._match_groups(merged))]
        with torch.no_grad():
            for group, target, (fp32, _, _, _) in zip(self.groups, self.opt_params, slices):
                if self.load_from_fp32_weights:
                    target.copy_(fp32)
                    if self.separate_master:
                        group.local.copy_(target)
                else:
                    target.copy_(group.local)  # master := the module's (possibly 16-bit) weights
            for domain, groups in self._by_domain():  # the module file holds rank 0's values only: those
                if domain.name is not None and domain.world_size > 1:  # differing by rank come from its partitions
                    gather_partitions(groups, domain.comm, self.allgather_elements, self.use_broadcast)
        if load_optimizer_states and self.optimizer is not None:
            states, groups, index = {}, [], 0
            for gi, (current, (_, elementwise, scalars, hyper)) in enumerate(zip(self.optimizer.param_groups, slices)):
                ids, lo = [], 0
                for chunk in self.chunks[gi]:
                    states[index] = {**{k: v[lo:lo + chunk.numel()] for k, v in elementwise.items()}, **scalars}
                    ids.append(index)
                    index, lo = index + 1, lo + chunk.numel()
                groups.append({**{k: v for k, v in current.items() if k != "params"}, **hyper, "params": ids})
            self.optimizer.load_state_dict({"state": states, "param_groups": groups})
            if self.offload is not None:
                self.offload.state_loaded()

    def _same_partitioning(self, state: dict) -> bool:
        return (state.get("layout") == "contiguous" and int(state.get("world_size", -1)) == self.world_size
                and int(state.get("rank", -1)) == self.rank and len(state["groups"]) == len(self.groups)
                and all(list(s["names"]) == g.names and int(s["partition_numel"]) == g.partition_numel
                        for s, g in zip(state["groups"], self.groups)))

    @staticmethod
    def _slice_of_saved_group(saved: dict):
        partition = int(saved["partition_numel"])
        elementwise, scalars = {}, {}
        for key, value in saved.get("state", {}).items():
            is_slice = isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == partition
            (elementwise if is_slice else scalars)[key] = value
        return saved["fp32"], elementwise, scalars, dict(saved.get("hyper", {}))

    def _match_groups(self, merged):
        if len(merged) != len(self.groups):
            raise CheckpointError(f"the checkpoint has {len(merged)} optimizer param group(s), this engine has "
                                  f"{len(self.groups)}")
        for gi, (m, g) in enumerate(zip(merged, self.groups)):
            if set(m.names) != set(g.names):
                missing, extra = sorted(set(g.names) - set(m.names)), sorted(set(m.names) - set(g.names))
                raise CheckpointError(f"param group {gi} of the checkpoint holds other parameters than this engine's: "
                                      f"missing {missing[:5]}, unexpected {extra[:5]}")
        return merged

    def _slice_of_merged_group(self, gi: int, merged):
        group = self.groups[gi]
        lo, hi = group.rank * group.partition_numel, (group.rank + 1) * group.partition_numel
        fp32 = group.flatten(merged.fp32)[lo:hi]
        elementwise = {key: group.flatten(per_name, dtype=next(iter(per_name.values())).dtype)[lo:hi].clone()
                       for key, per_name in merged.state.items()}
        return fp32, elementwise, dict(merged.scalars), dict(merged.hyper)

    # ------------------------------------------------------------------ DeepSpeed's keys (checkpoint hooks)
    def _ds_model_keys(self, engine) -> dict:
        from collections import OrderedDict

        shapes = [OrderedDict((n, torch.Size(s)) for n, s in zip(g.names, g.shapes)) for g in self.groups]
        return dsf.model_keys(self, param_shapes=shapes, world_size=self.world_size)

    def _ds_rank_keys(self, engine, state, options) -> dict:
        if self.optimizer is None:
            return {}
        keys = dsf.zero12_keys(state, self.precision, self.clip, self.optimizer.param_groups,
                               records=dsf.records_allowed(self))
        keys.update(ds_config=dsf._config_dict(self), ds_version=dsf.DS_VERSION)
        if self.precision.model_dtype == torch.bfloat16:  # DeepSpeed reads bf16_zero_pp_rank_* then
            dsf.write_extra_files(options, self.rank, {}, {dsf.optim_file(self.rank, True): dsf.optim_file(self.rank)})
        return keys

    def module_state_dict(self) -> dict:
        return self.module.state_dict()

    def load_module_state_dict(self, state: dict, strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)

    def refresh_master_from_model(self) -> None:
        if self.separate_master:
            with torch.no_grad():
                for group, master in zip(self.groups, self.opt_params):
                    master.copy_(group.local)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.offload is not None:  # the device releases its storage (files, memory)
            self.offload.close()

    # ------------------------------------------------------------------ full values of one parameter
    # Rank r holds the pieces of a parameter that fall into its partition (``FlatGroup.pieces``): a
    # full value is this rank's pieces written into zeros and summed over ranks (one all-reduce).
    def _group_of(self, param) -> Optional[FlatGroup]:
        for group in self.groups:
            if param in group.position:
                return group
        return None

    def _own_pieces(self, group: FlatGroup, param):
        """``(offset in the parameter, start in this rank's partition, length)`` of this rank's pieces."""
        offset, out = 0, []
        for owner, start, length in group.pieces(param):
            if owner == group.rank:
                out.append((offset, start, length))
            offset += length
        return out

    def _assemble(self, group: FlatGroup, param, read) -> torch.Tensor:
        """The full fp32 value whose piece at ``start`` of this rank's partition is ``read(start, length)``."""
        full = torch.zeros(param.numel(), dtype=torch.float32, device=group.buffer.device)
        for offset, start, length in self._own_pieces(group, param):
            full[offset:offset + length].copy_(read(start, length))
        domain = self.domains[group.index]
        if domain.world_size > 1:
            domain.comm.all_reduce(full)
        return full.view(param.shape)

    def _scatter(self, group: FlatGroup, param, value: torch.Tensor, write) -> None:
        flat = value.detach().reshape(-1)
        for offset, start, length in self._own_pieces(group, param):
            write(start, flat[offset:offset + length])

    def full_fp32_param(self, param) -> Optional[torch.Tensor]:
        group = self._group_of(param)
        if group is None:
            return None
        master = self.opt_params[group.index]
        return self._assemble(group, param, lambda start, n: master[start:start + n])

    def set_full_fp32_param(self, param, value: torch.Tensor) -> None:
        group = self._group_of(param)
        if group is None:
            return
        master = self.opt_params[group.index]
        with torch.no_grad():
            param.data.copy_(value)  # every rank holds the whole (training-dtype) buffer
            if self.separate_master:
                self._scatter(group, param, value, lambda start, piece: master[start:start + piece.numel()].copy_(piece))

    def full_grad(self, param) -> Optional[torch.Tensor]:
        """The reduced gradient partition (after the backward that reduced it), gathered."""
        group = self._group_of(param)
        part = None if group is None or not self._accumulating else self.partition_grads[group.index]
        if part is None:
            return None
        return self._assemble(group, param, lambda start, n: part[start:start + n])

    def _state_slices(self, gi: int, key: str, start: int, length: int) -> List[torch.Tensor]:
        """Views of the element-wise state ``key`` over ``[start, start+length)`` of partition ``gi``
        (the optimizer keeps it per chunk of OPTIMIZER_CHUNK elements)."""
        out, chunk_start = [], 0
        for chunk in self.chunks[gi]:
            lo, hi = max(start, chunk_start), min(start + length, chunk_start + chunk.numel())
            if lo < hi:
                out.append(self.optimizer.state[chunk][key][lo - chunk_start:hi - chunk_start])
            chunk_start += chunk.numel()
        return out

    def _state_kind(self, gi: int, key: str):
        """The state ``key`` of group ``gi``'s first chunk (the same kind on every rank), or None."""
        if self.optimizer is None:
            return None
        return self.optimizer.state.get(self.chunks[gi][0], {}).get(key)

    def full_optimizer_state(self, param, key: str):
        group = self._group_of(param)
        sample = None if group is None else self._state_kind(group.index, key)
        if sample is None:
            return None
        if not (torch.is_tensor(sample) and sample.dim() == 1 and sample.numel() == self.chunks[group.index][0].numel()):
            return sample.clone() if torch.is_tensor(sample) else sample  # a per-group scalar (step count ...)
        gi = group.index
        return self._assemble(group, param, lambda start, n: torch.cat(self._state_slices(gi, key, start, n)))

    def set_full_optimizer_state(self, param, key: str, value: torch.Tensor) -> None:
        group = self._group_of(param)
        if group is None or self._state_kind(group.index, key) is None:
            raise KeyError(f"the optimizer has no state {key!r} for this parameter yet (it is created by the first "
                           "step)")
        gi = group.index

        def write(start, piece):
            offset = 0
            for view in self._state_slices(gi, key, start, piece.numel()):
                view.copy_(piece[offset:offset + view.numel()])
                offset += view.numel()

        with torch.no_grad():
            self._scatter(group, param, value, write)

    # ------------------------------------------------------------------ accounting
    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes this rank holds now in parameters, gradients, optimizer states and bucket buffers."""
        params = sum(_nbytes(g.buffer) for g in self.groups)
        params += sum(_nbytes(p) for p in self.module.parameters() if p not in self._trainable)  # frozen
        grads = sum(_nbytes(t) for t in self.partition_grads)
        grads += sum(_nbytes(p.grad) for p in self.params) + sum(_nbytes(t) for t in self.accumulators.values())
        optim = sum(_nbytes(t) for t in self.opt_params) if self.separate_master else 0
        for chunk in (c for chunks in self.chunks for c in chunks):
            optim += sum(_nbytes(v) for v in self.optimizer.state.get(chunk, {}).values()
                         if isinstance(v, torch.Tensor))
        buffers = self.reducer.buffer_bytes()
        return {"parameters": params, "gradients": grads, "optimizer_states": optim, "buffers": buffers,
                "total": params + grads + optim}


#: the optimizer steps a partition as views of at most this many elements: an unfused optimizer's
#: temporaries then stay small (a partition-sized temporary costs memory and, freshly mapped every
#: step, page faults); element-wise optimizers compute the same either way
OPTIMIZER_CHUNK = 2 ** 22


def _chunk_views(t: torch.Tensor) -> List[torch.Tensor]:
    if t.numel() <= OPTIMIZER_CHUNK:
        return [t]
    return [t[a:a + OPTIMIZER_CHUNK] for a in range(0, t.numel(), OPTIMIZER_CHUNK)]


def _check_groups(param_groups: List[dict], names: dict, stage: int) -> None:
    seen = {}
    for gi, g in enumerate(param_groups):
        devices = {p.device for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"ZeRO stage {stage}: param group {gi} has parameters on several devices "
                             f"({', '.join(sorted(map(str, devices)))}); each group is flattened into one buffer")
        for i, p in enumerate(g["params"]):
            if p not in names:
                raise ValueError(f"ZeRO stage {stage}: parameter {i} of param group {gi} (shape {tuple(p.shape)}) is "
                                 f"not a parameter of the model; stage {stage} partitions and checkpoints the "
                                 "model's parameters by name")
            if p in seen:
                raise ValueError(f"ZeRO stage {stage}: parameter {names[p]!r} appears twice in the param groups "
                                 f"(group {seen[p]} and group {gi})")
            seen[p] = gi


def _offload_master(zero_config, context, stage: int):
    """``offload_optimizer``: the master partitions kept in its device (None: not offloaded)."""
    from .offload import HostMaster

    devices = open_devices(zero_config, context)
    if "offload_param" in devices:  # refused by the config rules; a stage built by hand gets this
        for device in devices.values():
            device.close()
        raise ValueError(f"zero_optimization.offload_param: ZeRO stage {stage} does not offload parameters "
                         "(a stage-3 feature)")
    device = devices.get("offload_optimizer")
    if device is None:
        return None
    try:
        return HostMaster(device, stage)
    except BaseException:
        device.close()
        raise


def _refuse_unimplemented(zero_config, stage: int) -> None:
    if zero_config is None:
        return
    if getattr(zero_config, "legacy_stage1", False):
        raise ValueError("zero_optimization.legacy_stage1=true: DeepSpeed's legacy stage 1 is not available in "
                         "dsplug; remove the key (stage 1 here is the current implementation)")
