"""The loader ``initialize(training_data=...)`` returns: sharded over ranks, micro-batch sized."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler


class RepeatingLoader:
    """Iterates a loader forever (DeepSpeed's ``RepeatingLoader``)."""

    def __init__(self, loader):
        self.loader = loader
        self.epoch = 0
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
            return next(self._it)


def build_dataloader(dataset, micro_batch_size: int, world_size: int, rank: int, collate_fn=None,
                     drop_last: bool = False, sampler=None, num_workers: int = 0, seed: int = 0,
                     batch_sampler=None, pin_memory=None) -> DataLoader:
    """``batch_sampler``: this rank's micro-batches of indices (a plugin's, see
    ``dsplug_dataloader_options``); it replaces ``sampler`` / ``micro_batch_size`` / ``drop_last``."""
    if isinstance(dataset, DataLoader):
        return dataset
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    if batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, num_workers=num_workers,
                          pin_memory=pin)
    if sampler is None:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                     drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, num_workers=num_workers, pin_memory=pin)
