"""The epoch plan: pure functions over integers (numpy only; no torch, no I/O).

:mod:`annbatch_torch.sampling.plan` is the chunked plan (chunks -> pools -> ranks ->
workers), :mod:`annbatch_torch.sampling.worklist` its work items and lazy work lists.
"""

from .plan import (
    EvenBatches,
    batch_positions,
    batches_per_rank,
    chunk_order,
    chunk_stream,
    epoch_pools,
    global_rows,
    item_permutation,
    n_chunks,
    pool_order,
    pool_permutation,
    pool_rows,
    rank_items,
    split_chunks,
    validate_params,
    worker_items,
)
from .worklist import (
    WorkItem,
    WorkList,
    consumed_per_worker,
    dataloader_order,
    remaining_items,
    total_batches,
)

__all__ = [
    "EvenBatches",
    "WorkItem",
    "WorkList",
    "validate_params",
    "n_chunks",
    "pool_rows",
    "chunk_order",
    "chunk_stream",
    "epoch_pools",
    "pool_permutation",
    "item_permutation",
    "batch_positions",
    "pool_order",
    "rank_items",
    "worker_items",
    "batches_per_rank",
    "dataloader_order",
    "consumed_per_worker",
    "remaining_items",
    "total_batches",
    "split_chunks",
    "global_rows",
]
