"""The collection on disk and AnnData elements; no torch.

Root modules: ``manifest`` (the JSON schema of a collection), ``source`` (``Source``: the
interface the reader pulls rows from, with lazy per-process handles), ``collection``
(``Collection``, a written collection, and ``open_collection``), ``metadata`` (obs / var frames and
categories), ``elements`` (row-range readers of one AnnData element), ``rowoffsets`` (a CSR
element's row offsets in a few bytes a row), ``checks`` (value and
structure checks), ``rawzarr`` (the array reader: our uncompressed chunks read with ``preadv``,
chunk objects from a :class:`~annbatch_torch.store.rawzarr.ChunkSource`), ``rawstrings``
(a string array's raw vlen-utf8 chunks read by position: a shard's obs names), ``diskio``
(``preadv`` reads, CPU slots and the disk gate), ``native`` (numba's set-up for every
compiled loop, and a compiled loop of ``preadv2`` reads), ``groups`` (a shard's hierarchy:
raw, zarr and mirrored arrays), ``zarrs`` (the zarrs codec pipeline).

Sub-wings: ``inputs/`` (AnnData inputs: opening, legacy files, the input view, the plan of a
list of inputs, harmonising fields, in-place reading, fingerprints) and ``remote/`` (collections
on object stores: the location, the local mirror, the chunk cache). ``inputs/`` may import the
root and ``remote/``; ``remote/`` imports only root modules that do not import it. Public names
are exported by :mod:`annbatch_torch`.
"""
