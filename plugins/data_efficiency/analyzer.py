"""``DataAnalyzer``: offline metrics of a dataset, the index files curriculum sampling reads.

DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.data_analyzer.DataAnalyzer``:

* **map** (:meth:`DataAnalyzer.run_map`): the dataset is cut into ``num_workers * num_threads``
  contiguous shards; worker ``worker_id`` (one launch, e.g. one node) computes its
  ``num_threads`` shards in that many worker processes (``multiprocessing``; one shard runs in
  this process). Each ``metric_function(batch)`` sees batches of ``batch_size`` consecutive samples
  (collated by ``collate_fn``, default torch's ``default_collate``) and returns one value per
  sample (``single_value_per_sample``) or a value summed over the batches
  (``accumulate_value_over_samples``). A shard writes
  ``<save_path>/<metric>/worker<w>_thread<t>/<metric>_sample_to_metric.npz`` (``indices``,
  ``values``) or ``<metric>_metric_value.npy``.
* **reduce** (:meth:`DataAnalyzer.run_reduce`, once, after every worker's map): merges the shards
  into ``<metric>_sample_to_metric``, ``<metric>_index_to_metric``, ``<metric>_index_to_sample``,
  ``<metric>_index_to_sample_percentile_merged`` (or ``<metric>_metric_value``), in the format
  of :mod:`.index_files`.

Deviations from DeepSpeed: files are numpy (``.npy`` / ``.npz`` rows), not MMapIndexedDataset;
``custom_map_*`` / ``custom_reduce`` and ``sample_indices`` are not supported (they raise);
``num_threads_reduce`` is accepted and reduce runs in one process (numpy sorts);
``start_method`` picks the multiprocessing start method (default ``fork`` where available).
"""
from __future__ import annotations

import os
import traceback
from typing import Callable, List, Optional, Sequence

import numpy as np

from . import index_files as files

METRIC_TYPES = ("single_value_per_sample", "accumulate_value_over_samples")


def shard_range(num_samples: int, shard: int, num_shards: int):
    """Samples ``[start, end)`` of shard ``shard`` of ``num_shards`` (contiguous, sizes differ by <= 1)."""
    return num_samples * shard // num_shards, num_samples * (shard + 1) // num_shards


def _to_numpy(value) -> np.ndarray:
    detach = getattr(value, "detach", None)
    if callable(detach):
        value = detach().cpu().numpy()
    return np.asarray(value)


class DataAnalyzer:
    def __init__(self, dataset, num_workers: int = 1, worker_id: int = 0, num_threads: int = 1,
                 num_threads_reduce: int = 1, specific_threads: Sequence[int] = (), batch_size: int = 1,
                 metric_names: Sequence[str] = (), metric_functions: Sequence[Callable] = (),
                 metric_types: Sequence[str] = (), metric_dtypes: Sequence = (), save_path: str = "./",
                 collate_fn: Optional[Callable] = None, custom_map_init=None, custom_map_update=None,
                 custom_map_finalize=None, custom_reduce=None, sample_indices=None,
                 start_method: Optional[str] = None):
        if any(f is not None for f in (custom_map_init, custom_map_update, custom_map_finalize, custom_reduce)):
            raise ValueError("DataAnalyzer: custom_map_* / custom_reduce are not available in dsplug; "
                                      "express the metric as a metric_function")
        if sample_indices is not None:
            raise ValueError("DataAnalyzer: sample_indices is not available in dsplug; samples are "
                                      "numbered by their position in the dataset")
        n = len(metric_names)
        if not n or not (len(metric_functions) == len(metric_types) == len(metric_dtypes) == n):
            raise ValueError(f"DataAnalyzer: metric_names, metric_functions, metric_types and metric_dtypes must "
                             f"have one entry per metric (got {len(metric_names)}, {len(metric_functions)}, "
                             f"{len(metric_types)}, {len(metric_dtypes)})")
        bad = [t for t in metric_types if t not in METRIC_TYPES]
        if bad:
            raise ValueError(f"DataAnalyzer: unknown metric_types {bad}; valid: {', '.join(METRIC_TYPES)}")
        if num_workers < 1 or num_threads < 1 or not 0 <= worker_id < num_workers or batch_size < 1:
            raise ValueError(f"DataAnalyzer: need num_workers >= 1, num_threads >= 1, batch_size >= 1 and "
                             f"0 <= worker_id < num_workers (got {num_workers}, {num_threads}, {batch_size}, "
                             f"{worker_id})")
        self.dataset = dataset
        self.num_workers = num_workers
        self.worker_id = worker_id
        self.num_threads = num_threads
        self.num_threads_reduce = num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size = batch_size
        self.metric_names = list(metric_names)
        self.metric_functions = list(metric_functions)
        self.metric_types = list(metric_types)
        self.metric_dtypes = [np.dtype(d) for d in metric_dtypes]
        self.save_path = os.fspath(save_path)
        self.collate_fn = collate_fn
        self.start_method = start_method

    # ------------------------------------------------------------------ map
    def shard_dir(self, metric: str, worker_id: int, thread_id: int) -> str:
        return os.path.join(self.save_path, metric, f"worker{worker_id}_thread{thread_id}")

    def run_map(self) -> None:
        """Compute this worker's shards: one worker process per thread (``num_threads > 1``)."""
        threads = self.specific_threads or list(range(self.num_threads))
        if len(threads) == 1:
            self._map_shard(threads[0])
            return
        import multiprocessing as mp

        method = self.start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        ctx = mp.get_context(method)
        errors = ctx.SimpleQueue()
        procs = [ctx.Process(target=_map_process, args=(self, t, errors), name=f"data-analyzer-{t}")
                 for t in threads]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        failures += [f"worker process {p.name} exited with code {p.exitcode}" for p in procs
                     if p.exitcode != 0 and not failures]
        if failures:
            raise RuntimeError("DataAnalyzer.run_map failed:\n" + "\n".join(failures))

    def _map_shard(self, thread_id: int) -> None:
        import torch
        from torch.utils.data import default_collate

        shard = self.worker_id * self.num_threads + thread_id
        start, end = shard_range(len(self.dataset), shard, self.num_workers * self.num_threads)
        collate = self.collate_fn or default_collate
        indices: List[List[np.ndarray]] = [[] for _ in self.metric_names]
        values: List[List[np.ndarray]] = [[] for _ in self.metric_names]
        totals: List[Optional[np.ndarray]] = [None for _ in self.metric_names]
        with torch.no_grad():
            for lo in range(start, end, self.batch_size):
                hi = min(end, lo + self.batch_size)
                batch = collate([self.dataset[i] for i in range(lo, hi)])
                for m, (name, fn, kind) in enumerate(zip(self.metric_names, self.metric_functions, self.metric_types)):
                    out = _to_numpy(fn(batch))
                    if kind == "single_value_per_sample":
                        out = out.reshape(-1)
                        if len(out) != hi - lo:
                            raise ValueError(f"metric {name!r}: metric_function returned {len(out)} values for a "
                                             f"batch of {hi - lo} samples (single_value_per_sample: one per sample)")
                        indices[m].append(np.arange(lo, hi, dtype=np.int64))
                        values[m].append(out.astype(self.metric_dtypes[m]))
                    else:
                        out = out.astype(self.metric_dtypes[m])
                        totals[m] = out if totals[m] is None else totals[m] + out
        for m, (name, kind) in enumerate(zip(self.metric_names, self.metric_types)):
            where = self.shard_dir(name, self.worker_id, thread_id)
            os.makedirs(where, exist_ok=True)
            if kind == "single_value_per_sample":
                idx = np.concatenate(indices[m]) if indices[m] else np.zeros(0, np.int64)
                val = np.concatenate(values[m]) if values[m] else np.zeros(0, self.metric_dtypes[m])
                path = os.path.join(where, f"{name}_sample_to_metric.npz")
                files._atomic(path, lambda f: np.savez(f, indices=idx, values=val))
            else:
                total = totals[m] if totals[m] is not None else np.zeros((), self.metric_dtypes[m])
                files.save_array(os.path.join(where, f"{name}_metric_value"), total)

    # ------------------------------------------------------------------ reduce
    def run_reduce(self) -> None:
        """Merge every worker's shards into the index files (run once, after every map)."""
        num_samples = len(self.dataset)
        for m, (name, kind, dtype) in enumerate(zip(self.metric_names, self.metric_types, self.metric_dtypes)):
            shards = [(w, t) for w in range(self.num_workers) for t in range(self.num_threads)]
            missing = [self.shard_dir(name, w, t) for w, t in shards
                       if not os.path.exists(self._shard_file(name, kind, w, t))]
            if missing:
                raise FileNotFoundError(f"DataAnalyzer.run_reduce: metric {name!r}: the map output of "
                                        f"{len(missing)} shard(s) is missing (run_map on every worker first): "
                                        f"{', '.join(missing[:4])}")
            if kind == "accumulate_value_over_samples":
                total = sum(files.load_array(self._shard_file(name, kind, w, t)) for w, t in shards)
                files.save_array(files.metric_file(self.save_path, name, "metric_value"), np.asarray(total, dtype))
                continue
            idx_parts, val_parts = [], []
            for w, t in shards:
                with np.load(self._shard_file(name, kind, w, t), allow_pickle=False) as z:
                    idx_parts.append(z["indices"])
                    val_parts.append(z["values"])
            indices, values = np.concatenate(idx_parts), np.concatenate(val_parts)
            if len(indices) != num_samples or not np.array_equal(np.sort(indices), np.arange(num_samples)):
                raise ValueError(f"DataAnalyzer.run_reduce: metric {name!r}: the shards hold {len(indices)} samples, "
                                 f"not each of the dataset's {num_samples} once (were they mapped with other "
                                 f"num_workers / num_threads?)")
            write_index_files(self.save_path, name, indices, values)

    def _shard_file(self, name: str, kind: str, w: int, t: int) -> str:
        where = self.shard_dir(name, w, t)
        if kind == "single_value_per_sample":
            return os.path.join(where, f"{name}_sample_to_metric.npz")
        return os.path.join(where, f"{name}_metric_value.npy")

    def run_map_reduce(self, comm_group=None) -> None:
        """Map then reduce, for one worker (``num_workers == 1``)."""
        if self.num_workers != 1:
            raise ValueError("DataAnalyzer.run_map_reduce runs the whole analysis in one launch (num_workers == 1); "
                             "with several workers call run_map on each, then run_reduce once")
        self.run_map()
        self.run_reduce()


def write_index_files(save_path: str, name: str, indices: np.ndarray, values: np.ndarray) -> None:
    """``<name>_sample_to_metric`` / ``_index_to_metric`` / ``_index_to_sample`` /
    ``_index_to_sample_percentile_merged`` from one value per sample."""
    order = np.lexsort((indices, values))  # by value, ties by sample index
    sorted_values, sorted_indices = values[order], indices[order].astype(np.int64)
    distinct, starts = np.unique(sorted_values, return_index=True)
    offsets = np.append(starts, len(sorted_values)).astype(np.int64)
    sample_to_metric = np.empty(len(values), dtype=values.dtype)
    sample_to_metric[indices] = values
    files.save_array(files.metric_file(save_path, name, "sample_to_metric"), sample_to_metric)
    files.save_array(files.metric_file(save_path, name, "index_to_metric"), distinct)
    files.save_rows(files.metric_file(save_path, name, "index_to_sample"), files.Rows(sorted_indices, offsets))
    merge_step = max(1, len(distinct) // 100)
    merged = np.append(offsets[:-1][::merge_step], len(sorted_values)).astype(np.int64)
    files.save_rows(files.metric_file(save_path, name, "index_to_sample_percentile_merged"),
                    files.Rows(sorted_indices, merged))


def _map_process(analyzer: DataAnalyzer, thread_id: int, errors) -> None:
    try:
        import torch

        torch.set_num_threads(1)  # one core per worker process
        analyzer._map_shard(thread_id)
    except BaseException:
        errors.put(f"thread {thread_id} (worker {analyzer.worker_id}):\n{traceback.format_exc()}")
        raise SystemExit(1)
