"""Local intersphinx inventories for an offline docs build.

intersphinx normally downloads each project's ``objects.inv``. The machines this site is
built on may have no network, so :func:`mapping` writes small inventories instead, from the
table below: the names these pages and docstrings refer to, each with its page on the
project's own documentation site (the links in the built site are the real ones). A name
missing here shows up as a nitpicky warning (``-W`` fails the build): add it with its URL.
With ``online=True`` the projects' published inventories are used instead.
"""

from __future__ import annotations

import zlib
from pathlib import Path

#: project -> (documentation root, {name: (role, path below the root, "" = the name's anchor)})
TABLE: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "python": ("https://docs.python.org/3/", {
        **{n: ("class", "library/functions.html#{n}") for n in (
            "int", "float", "bool", "object", "type", "range", "slice", "memoryview")},
        **{n: ("class", "library/stdtypes.html#{n}") for n in (
            "str", "bytes", "dict", "list", "tuple", "set", "frozenset")},
        "None": ("data", "library/constants.html#None"),
        "Ellipsis": ("data", "library/constants.html#Ellipsis"),
        **{n: ("exception", "library/exceptions.html#{n}") for n in (
            "Exception", "ValueError", "TypeError", "KeyError", "RuntimeError", "OSError",
            "ImportError", "FileNotFoundError", "IndexError", "NotImplementedError")},
        **{f"collections.abc.{n}": ("class", "library/collections.abc.html#collections.abc.{n}")
           for n in ("Sequence", "Mapping", "Callable", "Iterator", "Iterable",
                     "MutableMapping", "Collection", "Hashable", "Sized")},
        **{f"typing.{n}": ("data", "library/typing.html#typing.{n}")
           for n in ("Any", "Literal", "Optional", "Union", "TypeVar", "Protocol")},
        "os.PathLike": ("class", "library/os.html#os.PathLike"),
        "pathlib.Path": ("class", "library/pathlib.html#pathlib.Path"),
        "concurrent.futures.ThreadPoolExecutor": (
            "class", "library/concurrent.futures.html#concurrent.futures.ThreadPoolExecutor"),
        "logging.Logger": ("class", "library/logging.html#logging.Logger"),
        "multiprocessing": ("module", "library/multiprocessing.html#module-multiprocessing"),
        "pickle": ("module", "library/pickle.html#module-pickle"),
    }),
    "numpy": ("https://numpy.org/doc/stable/", {
        **{f"numpy.{n}": ("class", "reference/generated/numpy.{n}.html#numpy.{n}")
           for n in ("ndarray", "dtype", "int64", "int32", "float32", "float64", "bool_",
                     "integer", "floating", "generic")},
        "numpy.random.Generator": (
            "class", "reference/random/generator.html#numpy.random.Generator"),
        "numpy.random.default_rng": (
            "function", "reference/random/generator.html#numpy.random.default_rng"),
        "numpy.typing.ArrayLike": ("data", "reference/typing.html#numpy.typing.ArrayLike"),
    }),
    "scipy": ("https://docs.scipy.org/doc/scipy/", {
        **{f"scipy.sparse.{n}": ("class", "reference/generated/scipy.sparse.{n}.html"
                                          "#scipy.sparse.{n}")
           for n in ("csr_matrix", "csr_array", "csc_matrix", "spmatrix", "sparray")},
        "scipy.sparse": ("module", "reference/sparse.html#module-scipy.sparse"),
    }),
    "pandas": ("https://pandas.pydata.org/docs/", {
        **{f"pandas.{n}": ("class", "reference/api/pandas.{n}.html#pandas.{n}")
           for n in ("DataFrame", "Series", "Index", "Categorical", "CategoricalDtype")},
        "pandas.Series.value_counts": (
            "method", "reference/api/pandas.Series.value_counts.html"
                      "#pandas.Series.value_counts"),
    }),
    "torch": ("https://docs.pytorch.org/docs/stable/", {
        "torch.Tensor": ("class", "tensors.html#torch.Tensor"),
        "torch.device": ("class", "tensor_attributes.html#torch.device"),
        "torch.dtype": ("class", "tensor_attributes.html#torch.dtype"),
        "torch.Generator": ("class", "generated/torch.Generator.html#torch.Generator"),
        **{f"torch.{n}": ("function", "generated/torch.{n}.html#torch.{n}")
           for n in ("sparse_csr_tensor", "from_numpy", "manual_seed")},
        **{f"torch.utils.data.{n}": ("class", "data.html#torch.utils.data.{n}")
           for n in ("DataLoader", "Dataset", "IterableDataset", "Sampler",
                     "WeightedRandomSampler", "RandomSampler", "SubsetRandomSampler",
                     "DistributedSampler", "get_worker_info", "default_collate")},
        "torch.utils.data.dataset.IterableDataset": (
            "class", "data.html#torch.utils.data.IterableDataset"),
        "torch.distributed": ("module", "distributed.html#module-torch.distributed"),
        "torch.distributed.init_process_group": (
            "function", "distributed.html#torch.distributed.init_process_group"),
        "torch.nn.Module": ("class", "generated/torch.nn.Module.html#torch.nn.Module"),
    }),
    "torchdata": ("https://docs.pytorch.org/data/main/", {
        "torchdata.stateful_dataloader.StatefulDataLoader": (
            "class", "stateful_dataloader_tutorial.html"),
        "torchdata.stateful_dataloader.stateful_dataloader.StatefulDataLoader": (
            "class", "stateful_dataloader_tutorial.html"),
        "torchdata.stateful_dataloader.Stateful": (
            "class", "stateful_dataloader_tutorial.html"),
    }),
    "anndata": ("https://anndata.readthedocs.io/en/stable/", {
        **{f"anndata.{n}": ("class", "generated/anndata.{n}.html#anndata.{n}")
           for n in ("AnnData",)},
        **{f"anndata.{n}": ("function", "generated/anndata.{n}.html#anndata.{n}")
           for n in ("read_h5ad", "read_zarr", "concat")},
    }),
    "zarr": ("https://zarr.readthedocs.io/en/stable/", {
        "zarr.Array": ("class", "api/zarr/index.html#zarr.Array"),
        "zarr.Group": ("class", "api/zarr/index.html#zarr.Group"),
        "zarr.storage.LocalStore": (
            "class", "api/zarr/storage/index.html#zarr.storage.LocalStore"),
    }),
    "lightning": ("https://lightning.ai/docs/pytorch/stable/", {
        "lightning.pytorch.LightningDataModule": (
            "class", "api/lightning.pytorch.core.LightningDataModule.html"
                     "#lightning.pytorch.core.LightningDataModule"),
        "lightning.pytorch.core.LightningDataModule": (
            "class", "api/lightning.pytorch.core.LightningDataModule.html"
                     "#lightning.pytorch.core.LightningDataModule"),
        "lightning.pytorch.core.datamodule.LightningDataModule": (
            "class", "api/lightning.pytorch.core.LightningDataModule.html"
                     "#lightning.pytorch.core.LightningDataModule"),
        "lightning.pytorch.LightningModule": (
            "class", "api/lightning.pytorch.core.LightningModule.html"
                     "#lightning.pytorch.core.LightningModule"),
        "lightning.pytorch.Trainer": (
            "class", "common/trainer.html#lightning.pytorch.trainer.trainer.Trainer"),
    }),
    "distributed": ("https://distributed.dask.org/en/stable/", {
        "distributed.Client": ("class", "api.html#distributed.Client"),
        "dask.distributed.Client": ("class", "api.html#distributed.Client"),
        "distributed.LocalCluster": ("class", "api.html#distributed.LocalCluster"),
    }),
    "scvi": ("https://docs.scvi-tools.org/en/stable/", {
        "scvi.model.SCVI": ("class", "api/reference/scvi.model.SCVI.html#scvi.model.SCVI"),
        "scvi.model.SCANVI": (
            "class", "api/reference/scvi.model.SCANVI.html#scvi.model.SCANVI"),
    }),
}

def _write(path: Path, project: str, entries: dict[str, tuple[str, str]]) -> None:
    lines = []
    for name, (role, uri) in sorted(entries.items()):
        uri = uri.format(n=name.rsplit(".", 1)[-1])
        lines.append(f"{name} py:{role} 1 {uri} -")
    body = zlib.compress(("\n".join(lines) + "\n").encode())
    header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: \n"
              "# The remainder of this file is compressed using zlib.\n").encode()
    path.write_bytes(header + body)


def mapping(folder: Path, online: bool = False) -> dict[str, tuple[str, str | None]]:
    """``intersphinx_mapping``: each project's root with a local inventory written into
    ``folder`` (or ``None``: the published one, with ``online``)."""
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, tuple[str, str | None]] = {}
    for project, (root, entries) in TABLE.items():
        if online:
            out[project] = (root, None)
            continue
        path = folder / f"{project}.inv"
        _write(path, project, entries)
        out[project] = (root, str(path))
    return out
