"""annbatch_torch: a PyTorch-native, chunk-shuffled data loader for AnnData.

Quick tour::

    import annbatch_torch as abt
    from annbatch_torch import A

    coll = abt.create_anndata_collection(["a.h5ad", "b.h5ad"], "store/")
    ds = abt.AnnBatchDataset(coll, selector={"x": A.X, "y": A.obs["cell_type"]},
                             batch_size=4096, densify=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=4)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .annbatch_dataset import AnnBatchDataset
from .convert import batch_dict_converter, to_device
from .errors import (
    AnnBatchError,
    BatchError,
    CollectionError,
    InputError,
    ReadError,
    SamplerError,
    SchemaError,
)
from .fields import A, Field
from .loader import AnnBatchDataLoader
from .sampling.samplers import ClassBalancedSampler, Sampler, SubsetSampler, WeightedSampler
from .store.collection import Collection, Source, open_collection
from .store.zarrs import set_codec_pipeline

if TYPE_CHECKING:
    from .lightning import AnnBatchDataModule
    from .write.append import append_to_collection
    from .write.prepare import prepare_collection
    from .write.writer import create_anndata_collection

__version__ = "0.1.0"

__all__ = [
    "A",
    "AnnBatchDataLoader",
    "AnnBatchDataModule",
    "AnnBatchDataset",
    "AnnBatchError",
    "BatchError",
    "ClassBalancedSampler",
    "Collection",
    "CollectionError",
    "Field",
    "InputError",
    "ReadError",
    "Sampler",
    "SamplerError",
    "SchemaError",
    "Source",
    "SubsetSampler",
    "WeightedSampler",
    "append_to_collection",
    "batch_dict_converter",
    "create_anndata_collection",
    "datasets",
    "open_collection",
    "prepare_collection",
    "set_codec_pipeline",
    "to_device",
]


def __getattr__(name: str) -> Any:
    # lazy: the writer pulls in anndata's writer stack, the DataModule needs `lightning`
    if name == "create_anndata_collection":
        from .write.writer import create_anndata_collection

        return create_anndata_collection
    if name == "append_to_collection":
        from .write.append import append_to_collection

        return append_to_collection
    if name == "prepare_collection":
        from .write.prepare import prepare_collection

        return prepare_collection
    if name == "AnnBatchDataModule":
        from .lightning import AnnBatchDataModule

        return AnnBatchDataModule
    if name == "datasets":
        # not `from . import datasets`: its hasattr() check re-enters this __getattr__
        import importlib

        return importlib.import_module(f"{__name__}.datasets")
    raise AttributeError(f"module 'annbatch_torch' has no attribute {name!r}")
