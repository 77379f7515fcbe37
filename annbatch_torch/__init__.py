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
from .sampling.pairing import MissingControlWarning, PairedSampler
from .sampling.samplers import ClassBalancedSampler, Sampler, SubsetSampler, WeightedSampler
from .store.collection import Collection, open_collection
from .store.inputs.inplace import open_source
from .store.inputs.mixture import Mixture, mix
from .store.source import Source
from .store.zarrs import set_codec_pipeline

if TYPE_CHECKING:
    from .annbatch_dataset import AnnBatchDataset
    from .convert import batch_dict_converter, to_device
    from .diversity import diversity_report
    from .lightning import AnnBatchDataModule
    from .loader import AnnBatchDataLoader
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
    "MissingControlWarning",
    "Mixture",
    "PairedSampler",
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
    "diversity_report",
    "mix",
    "open_collection",
    "open_source",
    "prepare_collection",
    "set_codec_pipeline",
    "to_device",
]


#: names imported on first use: the torch face (torch takes seconds to import, and the
#: writer's worker processes never need it), the writer (anndata's writer stack) and the
#: DataModule (``lightning``)
_LAZY = {
    "AnnBatchDataset": "annbatch_dataset",
    "AnnBatchDataLoader": "loader",
    "batch_dict_converter": "convert",
    "to_device": "convert",
    "diversity_report": "diversity",
    "create_anndata_collection": "write.writer",
    "append_to_collection": "write.append",
    "prepare_collection": "write.prepare",
    "AnnBatchDataModule": "lightning",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    if name == "datasets":
        # not `from . import datasets`: its hasattr() check re-enters this __getattr__
        return importlib.import_module(f"{__name__}.datasets")
    raise AttributeError(f"module 'annbatch_torch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
