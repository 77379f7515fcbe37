"""The epoch plan: pure functions over integers (numpy only; no torch, no I/O).

:mod:`~annbatch_torch.sampling.plan` deals an epoch's chunks into pools, ranks and workers;
:mod:`~annbatch_torch.sampling.worklist` holds its complete work items (a pool's ranges,
row order and batches). The rules are in the docstring of
:mod:`~annbatch_torch.sampling.plan`. Sampling mode: :mod:`~annbatch_torch.sampling.samplers`
(which rows an epoch holds) and :mod:`~annbatch_torch.sampling.sampled_plan` (their stream
dealt like chunked mode's).
"""

from .plan import (
    TAG_CHUNKS,
    TAG_SPLIT,
    EvenBatches,
    batch_positions,
    batches_per_rank,
    chunk_order,
    chunk_stream,
    deal_pools,
    epoch_pools,
    n_chunks,
    pool_rows,
    rank_batches,
    rank_items,
    split_chunks,
    validate_params,
    worker_items,
)
from .sampled_plan import SampleRows, sample_batches_per_rank, sample_rank_items
from .samplers import (
    BLOCK,
    TAG_SAMPLE,
    ClassBalancedSampler,
    ObsColumn,
    Sampler,
    SubsetSampler,
    WeightedSampler,
)
from .worklist import (
    TAG_ROWS,
    ChunkRows,
    PoolRows,
    RowOrder,
    WorkItem,
    WorkList,
    global_rows,
    item_permutation,
    pool_order,
    pool_permutation,
    remaining_items,
    total_batches,
)

__all__ = [
    "EvenBatches",
    "TAG_CHUNKS",
    "TAG_ROWS",
    "TAG_SPLIT",
    "RowOrder",
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
    "remaining_items",
    "total_batches",
    "split_chunks",
    "global_rows",
    "deal_pools",
    "rank_batches",
    "ChunkRows",
    "PoolRows",
    "SampleRows",
    "sample_rank_items",
    "sample_batches_per_rank",
    "BLOCK",
    "TAG_SAMPLE",
    "ObsColumn",
    "Sampler",
    "WeightedSampler",
    "ClassBalancedSampler",
    "SubsetSampler",
]
