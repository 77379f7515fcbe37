"""The epoch plan: pure functions over integers (numpy only; no torch, no I/O).

``sampling/plan.py`` deals an epoch's chunks into pools, ranks and workers, and its
``ChunkPlan`` answers a dataset's planning questions; ``sampling/worklist.py`` holds its
complete work items (a pool's ranges, row order and batches). The rules are in the
docstring of ``sampling/plan.py``. Sampling mode: ``sampling/samplers.py`` (which rows an
epoch holds) and ``sampling/sampled_plan.py`` (their stream dealt like chunked mode's:
``SamplePlan``). ``sampling/replay.py``: what each worker of each rank has consumed of an
epoch, and what a resumed epoch still owes (a resumed epoch's deal is the plan).
``sampling/diversity.py``: how mixed batches are (per-batch class counts, entropy, and
those of truly random batches), the figures of the shuffle-quality report.
``sampling/pairing.py``: perturbation / control pairing, ``PairedSampler``'s stream in draws
of a perturbed row and its controls (``SamplePlan`` deals them in batches of whole draws).
``sampling/mixing.py``: ``MixSampler``, the stream of a weighted mixture of sources (per-batch
quotas, runs of each member, pools permuted within each member's positions).
"""

from .pairing import TAG_PAIR, MissingControlWarning, PairedSampler
from .plan import (
    MAX_ROWS,
    TAG_CHUNKS,
    TAG_SPLIT,
    ChunkPlan,
    EpochDeal,
    EpochPlan,
    EvenBatches,
    batch_positions,
    batches_per_rank,
    chunk_deal,
    chunk_order,
    chunk_rows,
    chunk_stream,
    deal_batches,
    deal_pools,
    epoch_batches,
    epoch_pools,
    n_chunks,
    pool_rows,
    rank_batches,
    rank_items,
    split_chunks,
    split_chunks3,
    validate_params,
    worker_items,
)
from .replay import (
    Segment,
    consumed_per_worker,
    dataloader_order,
    rank_items_after,
    remaining_batches,
)
from .sampled_plan import (
    SamplePlan,
    SampleRows,
    draw_layout,
    sample_batches_per_rank,
    sample_deal,
    sample_rank_items,
)
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
    "MAX_ROWS",
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
    "split_chunks3",
    "chunk_rows",
    "global_rows",
    "deal_pools",
    "deal_batches",
    "epoch_batches",
    "EpochDeal",
    "EpochPlan",
    "ChunkPlan",
    "SamplePlan",
    "chunk_deal",
    "sample_deal",
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
    "PairedSampler",
    "MissingControlWarning",
    "TAG_PAIR",
    "draw_layout",
    "Segment",
    "dataloader_order",
    "consumed_per_worker",
    "remaining_batches",
    "rank_items_after",
]
