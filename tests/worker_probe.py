"""A ``batch_converter`` that reports what the producing DataLoader worker knew.

Kept apart from the Lightning helpers so that spawned workers, which import the module of
the converter they unpickle, do not import Lightning too.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import get_worker_info

import annbatch_torch as abt


def epoch_converter(batch: dict[str, Any]) -> dict[str, Any]:
    """Default conversion plus the epoch the worker's own dataset copy holds when it converts
    the batch (``-1`` without workers) and the worker's pid.

    The shared epoch can move on after the worker planned its iteration (Lightning creates
    the first iterator before ``set_epoch``), so tests also compare the batches themselves
    with those of a fresh dataset at that epoch.
    """
    out: dict[str, Any] = abt.batch_dict_converter(batch)
    info = get_worker_info()
    out["worker_epoch"] = torch.tensor(info.dataset.epoch if info is not None else -1)
    out["worker_pid"] = torch.tensor(os.getpid())
    return out
