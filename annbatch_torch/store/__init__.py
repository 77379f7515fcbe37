"""The collection on disk and AnnData elements; no torch.

``manifest`` (the JSON schema of a collection), ``collection`` (``Source`` / ``Collection``:
shards, fields, lazy per-process handles), ``inputs`` (opening h5ad / zarr / in-memory
AnnData inputs), ``inplace`` (reading such inputs where they are), ``elements`` (row-range
readers of one AnnData element), ``checks`` (value and structure checks), ``rawzarr`` (our
uncompressed chunks read with ``preadv``), ``zarrs`` (the zarrs codec pipeline). Public
names are exported by :mod:`annbatch_torch`.
"""
