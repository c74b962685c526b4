"""The on-disk format of the data analyzer's index files (numpy; DeepSpeed uses MMapIndexedDataset).

Files of metric ``m`` under ``<save_path>/<m>/`` (DeepSpeed's names plus a suffix):

* ``m_sample_to_metric.npy`` -- 1-D: the metric of sample ``i`` at ``[i]``
  (``single_value_per_sample``);
* ``m_index_to_metric.npy`` -- 1-D, ascending: the distinct metric values;
* ``m_index_to_sample.npz`` -- *rows*: row ``v`` holds the sample indices (ascending) whose metric
  is ``index_to_metric[v]``;
* ``m_index_to_sample_percentile_merged.npz`` -- *rows*: consecutive rows of
  ``m_index_to_sample`` merged ``max(1, len // 100)`` at a time (DeepSpeed's merge), so about 100
  rows; concatenated, its rows are every sample ordered by metric (ties by index);
* ``m_metric_value.npy`` -- the accumulated value (``accumulate_value_over_samples``).

A *rows* file is an ``.npz`` with two arrays: ``data`` (the rows concatenated) and ``offsets``
(``len(rows) + 1`` int64; row ``i`` is ``data[offsets[i]:offsets[i + 1]]``). Everything loads
with ``np.load(path, allow_pickle=False)``.
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

ROWS_SUFFIX = ".npz"
ARRAY_SUFFIX = ".npy"


class Rows:
    """A rows file in memory: ``len(rows)``, ``rows[i]`` (an array), ``rows.data``, ``rows.offsets``."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data = np.asarray(data)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[0] != 0 \
                or self.offsets[-1] != len(self.data) or np.any(np.diff(self.offsets) < 0):
            raise ValueError("malformed rows: offsets must start at 0, not decrease, and end at len(data)")

    @classmethod
    def from_list(cls, rows: Sequence[Iterable], dtype=np.int64) -> "Rows":
        arrays = [np.asarray(list(r) if not isinstance(r, np.ndarray) else r, dtype=dtype).reshape(-1) for r in rows]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(a) for a in arrays])
        data = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
        return cls(data, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.data[self.offsets[i]:self.offsets[i + 1]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def with_suffix(path: str, suffix: str) -> str:
    path = os.fspath(path)
    return path if path.endswith(suffix) else path + suffix


def _atomic(path: str, write) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)
    return path


def save_rows(path: str, rows: Rows) -> str:
    path = with_suffix(path, ROWS_SUFFIX)
    return _atomic(path, lambda f: np.savez(f, data=rows.data, offsets=rows.offsets))


def load_rows(path: str) -> Rows:
    path = with_suffix(path, ROWS_SUFFIX)
    with np.load(path, allow_pickle=False) as z:
        return Rows(z["data"], z["offsets"])


def save_array(path: str, array) -> str:
    path = with_suffix(path, ARRAY_SUFFIX)
    return _atomic(path, lambda f: np.save(f, np.asarray(array), allow_pickle=False))


def load_array(path: str) -> np.ndarray:
    return np.load(with_suffix(path, ARRAY_SUFFIX), allow_pickle=False)


def metric_file(save_path: str, metric: str, kind: str) -> str:
    """``<save_path>/<metric>/<metric>_<kind>`` plus its suffix."""
    suffix = ROWS_SUFFIX if kind.startswith("index_to_sample") else ARRAY_SUFFIX
    return os.path.join(os.fspath(save_path), metric, f"{metric}_{kind}{suffix}")
