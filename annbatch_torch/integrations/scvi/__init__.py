"""scvi-tools models trained straight from a collection (the ``scvi`` extra).

:class:`SCVIDataModule` follows scvi-tools' custom-dataloader protocol (``registry=`` and
``train(datamodule=...)``); :mod:`.setup` resolves the keys into scvi-tools' registry,
:mod:`.batches` builds the batches in its keys. Import it yourself: nothing in
``annbatch_torch`` imports this package.
"""

from .datamodule import SCVIDataModule

__all__ = ["SCVIDataModule"]
