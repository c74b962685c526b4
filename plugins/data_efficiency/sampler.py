"""``DeepSpeedDataSampler``: curriculum data sampling, a batch sampler of this rank's micro-batches.

Every rank computes the same global batches (``train_batch_size = micro * dp * gas`` samples)
and takes its part: micro-step ``j`` of a global batch is its slice ``[j * micro * dp, (j + 1) *
micro * dp)``, of which rank ``r`` gets ``[r * micro, (r + 1) * micro)`` (DeepSpeed's order).

Global batch ``k`` (the curriculum step, counted from 1):

1. each metric's difficulty is ``schedule.update_difficulty(k)`` (:mod:`.schedules`);
2. with ``clustering_type: schedule_based``, the samples within the difficulty of every such
   metric are *accepted*: ``value`` accepts metric values ``<= difficulty``; ``percentile``
   accepts the first ``floor(N * difficulty / 100)`` samples ordered by the metric (ties by
   index). Samples accepted for the first time form a new *cluster* (a difficulty only ever
   admits samples; clusters stay). ``single_cluster`` metrics do not filter: the dataset is one
   cluster and the difficulty is for post-processing (``sampler.current_difficulties``);
3. how many samples come from each cluster is drawn like drawing ``B`` of the admitted samples
   without replacement (multivariate hypergeometric over the cluster sizes; with fewer admitted
   samples than ``B``, multinomial with replacement). Each cluster is read in its own shuffled
   order, reshuffled when exhausted (a sample just served at the end of one order is not served
   again within the same global batch); the batch is shuffled.

Randomness is counter based: batch ``k`` uses ``numpy.random.default_rng([seed, 0, k])`` and
cluster ``c``'s ``e``-th order ``default_rng([seed, 1, c, e])``, so the state
(:meth:`state_dict`: consumed samples, curriculum step, difficulties, the difficulties that
created each cluster, each cluster's position and epoch, the rest of the current global batch)
is plain integers, and a resumed sampler yields exactly the remaining order. Clusters are
rebuilt in memory from the index files (``data_cluster_path`` is not used). The sampler stops
after ``num_epochs * N`` samples (the last, partial global batch only when ``drop_last`` is
false).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Union

import numpy as np

from . import index_files as files
from .config import DataEfficiencyConfig
from .schedules import CurriculumSchedule


def _parse(config) -> DataEfficiencyConfig:
    if isinstance(config, DataEfficiencyConfig):
        return config
    from dsplug.config.schema import parse

    return parse(DataEfficiencyConfig, dict(config), "data_efficiency")


class _MetricIndex:
    """What one schedule_based metric accepts at a difficulty."""

    def __init__(self, name: str, metric_config, num_samples: int):
        self.name = name
        self.type = metric_config.difficulty_type
        try:
            rows = files.load_rows(metric_config.index_to_sample_path)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"curriculum metric {name!r}: index_to_sample_path "
                                    f"{metric_config.index_to_sample_path!r} not found (write it with "
                                    f"DataAnalyzer)") from exc
        if len(rows.data) != num_samples:
            raise ValueError(f"curriculum metric {name!r}: {metric_config.index_to_sample_path} indexes "
                             f"{len(rows.data)} samples but the dataset has {num_samples}")
        self.rows = rows
        if self.type == "value":
            self.values = np.asarray(files.load_array(metric_config.index_to_metric_path)).reshape(-1)
            if len(self.values) != len(rows):
                raise ValueError(f"curriculum metric {name!r}: {metric_config.index_to_sample_path} has {len(rows)} "
                                 f"rows but {metric_config.index_to_metric_path} has {len(self.values)} values; "
                                 f"difficulty_type 'value' needs <metric>_index_to_sample (not the "
                                 f"percentile_merged file)")

    def accepted(self, difficulty) -> np.ndarray:
        if self.type == "value":
            rows = int(np.searchsorted(self.values, difficulty, side="right"))
            return self.rows.data[:self.rows.offsets[rows]]
        count = min(len(self.rows.data), int(math.floor(len(self.rows.data) * float(difficulty) / 100.0)))
        return self.rows.data[:count]


class DeepSpeedDataSampler:
    """A batch sampler (``DataLoader(dataset, batch_sampler=...)``) of this rank's micro-batches."""

    def __init__(self, data_efficiency_config, one_epoch_total_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_parallel_group=None,
                 gradient_accumulation_steps: int = 1, global_rank: int = 0, drop_last: bool = True):
        config = _parse(data_efficiency_config)
        self.config = config
        self.seed = int(config.seed)
        sampling = config.data_sampling
        self.one_epoch_total_samples = int(one_epoch_total_samples)
        self.total_samples = self.one_epoch_total_samples * sampling.num_epochs
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        self.global_rank = global_rank
        self.drop_last = bool(drop_last)
        self.micro_batch_times_data_parallel_size = self.micro_batch_size * self.data_parallel_size
        self.global_batch_size = self.micro_batch_times_data_parallel_size * self.gradient_accumulation_steps
        if not 0 <= self.data_parallel_rank < self.data_parallel_size or self.micro_batch_size < 1:
            raise ValueError(f"DeepSpeedDataSampler: rank {data_parallel_rank} of {data_parallel_size}, micro batch "
                             f"{micro_batch_size}")
        metrics = sampling.curriculum_learning.curriculum_metrics
        self.curriculum_schedulers: Dict[str, CurriculumSchedule] = {
            name: CurriculumSchedule(m, name) for name, m in metrics.items()}
        self._filtering = {name: m for name, m in metrics.items() if m.clustering_type == "schedule_based"}
        self._indexes = {n: _MetricIndex(n, m, self.one_epoch_total_samples) for n, m in self._filtering.items()}
        # ---- state
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: Dict[str, float] = {}
        self.batch: List[int] = []
        self.cluster_difficulties: List[Dict[str, float]] = []
        self.cluster_positions: List[int] = []
        self.cluster_epochs: List[int] = []
        # ---- derived from the state
        self._clusters: List[np.ndarray] = []
        self._admitted = np.zeros(self.one_epoch_total_samples, dtype=bool)
        self._evaluated: Optional[Dict[str, float]] = None
        self._orders: Dict[int, tuple] = {}

    # ------------------------------------------------------------------ schedules
    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Union[Callable, Mapping[str, Callable]]):
        """``{metric: fn(step) -> difficulty}`` (DeepSpeed), or one ``fn`` for every ``custom`` metric."""
        if callable(schedule_func_dict):
            schedule_func_dict = {n: schedule_func_dict for n, s in self.curriculum_schedulers.items()
                                  if s.type == "custom"}
        for metric, fn in schedule_func_dict.items():
            if metric in self.curriculum_schedulers:
                self.curriculum_schedulers[metric].set_custom_get_difficulty(fn)

    def get_difficulties(self) -> Dict[str, float]:
        return dict(self.current_difficulties)

    # ------------------------------------------------------------------ clusters
    def _accepted_mask(self, difficulties: Mapping[str, float]) -> np.ndarray:
        if not self._filtering:
            return np.ones(self.one_epoch_total_samples, dtype=bool)
        mask = np.ones(self.one_epoch_total_samples, dtype=bool)
        for name, index in self._indexes.items():
            one = np.zeros(self.one_epoch_total_samples, dtype=bool)
            one[index.accepted(difficulties[name])] = True
            mask &= one
        return mask

    def _admit(self, difficulties: Mapping[str, float]) -> bool:
        """Add the cluster of samples first accepted at ``difficulties``; True if there was one."""
        mask = self._accepted_mask(difficulties)
        new = np.flatnonzero(mask & ~self._admitted)
        if len(new) == 0:
            return False
        self._admitted |= mask
        self._clusters.append(new)
        return True

    def _order(self, cluster: int) -> np.ndarray:
        epoch = self.cluster_epochs[cluster]
        cached = self._orders.get(cluster)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, 1, cluster, epoch])
            cached = (epoch, rng.permutation(self._clusters[cluster]))
            self._orders[cluster] = cached
        return cached[1]

    def _take(self, cluster: int, count: int) -> List[int]:
        size = len(self._clusters[cluster])
        pos = self.cluster_positions[cluster]
        if pos + count <= size:
            self.cluster_positions[cluster] = pos + count
            return self._order(cluster)[pos:pos + count].tolist()
        out: List[int] = []
        seen = set() if count <= size else None  # no repeats within a batch when the cluster is big enough
        while len(out) < count:
            order, pos = self._order(cluster), self.cluster_positions[cluster]
            while pos < size and len(out) < count:
                x = int(order[pos])
                pos += 1
                if seen is not None:
                    if x in seen:
                        continue
                    seen.add(x)
                out.append(x)
            self.cluster_positions[cluster] = pos
            if len(out) < count:
                self.cluster_epochs[cluster] += 1
                self.cluster_positions[cluster] = 0
        return out

    # ------------------------------------------------------------------ global batches
    def get_next_global_batch(self) -> None:
        step = self.curriculum_step + 1
        difficulties = {name: s.update_difficulty(step) for name, s in self.curriculum_schedulers.items()}
        self.curriculum_step, self.current_difficulties = step, difficulties  # after a custom schedule could raise
        if self._evaluated != self.current_difficulties:
            if self._admit(self.current_difficulties):
                self.cluster_difficulties.append(dict(self.current_difficulties))
                self.cluster_positions.append(0)
                self.cluster_epochs.append(0)
            self._evaluated = dict(self.current_difficulties)
        sizes = np.array([len(c) for c in self._clusters], dtype=np.int64)
        pool = int(sizes.sum())
        if pool == 0:
            raise RuntimeError(f"curriculum learning: no sample is within the difficulties {self.current_difficulties} "
                               f"at step {self.curriculum_step}; raise min_difficulty")
        size = min(self.global_batch_size, self.total_samples - self.consumed_samples)
        rng = np.random.default_rng([self.seed, 0, self.curriculum_step])
        counts = rng.multivariate_hypergeometric(sizes, size) if pool >= size else rng.multinomial(size, sizes / pool)
        batch = [x for c, k in enumerate(counts) if k for x in self._take(c, int(k))]
        self.batch = [int(x) for x in rng.permutation(np.asarray(batch, dtype=np.int64))]

    def get_start_end_idx(self, batch_len: Optional[int] = None):
        batch_len = self.micro_batch_times_data_parallel_size if batch_len is None else batch_len
        start = self.data_parallel_rank * batch_len // self.data_parallel_size
        end = (self.data_parallel_rank + 1) * batch_len // self.data_parallel_size
        return start, end

    def __iter__(self):
        while True:
            if not self.batch:
                remaining = self.total_samples - self.consumed_samples
                if remaining <= 0 or (remaining < self.global_batch_size and self.drop_last):
                    return
                self.get_next_global_batch()
            current = self.batch[:self.micro_batch_times_data_parallel_size]
            self.batch = self.batch[self.micro_batch_times_data_parallel_size:]
            self.consumed_samples += len(current)
            if len(current) < self.data_parallel_size:
                continue  # too few to give every rank a sample (only the final partial batch)
            start, end = self.get_start_end_idx(len(current))
            yield current[start:end]

    def __len__(self) -> int:
        """Micro-batches this rank yields from the start to the end."""
        full, rest = divmod(self.total_samples, self.global_batch_size)
        count = full * self.gradient_accumulation_steps
        if rest and not self.drop_last:
            count += -(-rest // self.micro_batch_times_data_parallel_size)
        return count

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "epoch": self.consumed_samples // max(1, self.one_epoch_total_samples),
            "current_difficulties": dict(self.current_difficulties),
            "batch": list(self.batch),
            "cluster_difficulties": [dict(d) for d in self.cluster_difficulties],
            "cluster_positions": list(self.cluster_positions),
            "cluster_epochs": list(self.cluster_epochs),
            "seed": self.seed,
            "one_epoch_total_samples": self.one_epoch_total_samples,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: Mapping) -> None:
        if int(state["one_epoch_total_samples"]) != self.one_epoch_total_samples:
            raise ValueError(f"data sampler state is of a dataset of {state['one_epoch_total_samples']} samples; this "
                             f"one has {self.one_epoch_total_samples}")
        self.consumed_samples = int(state["consumed_samples"])
        self.curriculum_step = int(state["curriculum_step"])
        self.current_difficulties = dict(state["current_difficulties"])
        for name, value in self.current_difficulties.items():
            if name in self.curriculum_schedulers:
                self.curriculum_schedulers[name].current_difficulty = value
        self.batch = [int(x) for x in state["batch"]]
        self.seed = int(state.get("seed", self.seed))
        self._clusters, self._orders = [], {}
        self._admitted = np.zeros(self.one_epoch_total_samples, dtype=bool)
        for difficulties in state["cluster_difficulties"]:
            if not self._admit(difficulties):
                raise ValueError("data sampler state: a saved cluster is empty with these index files (were the "
                                 "index files rewritten since the checkpoint?)")
        self.cluster_difficulties = [dict(d) for d in state["cluster_difficulties"]]
        self.cluster_positions = [int(x) for x in state["cluster_positions"]]
        self.cluster_epochs = [int(x) for x in state["cluster_epochs"]]
        self._evaluated = dict(self.current_difficulties) if self.current_difficulties else None
