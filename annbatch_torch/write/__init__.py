"""The offline shuffle; no torch: ``writer`` (``create_anndata_collection``), ``schema``
(the fields a collection stores), ``shardio`` (bucket files, shard writing), ``budget``
(the ``max_memory`` accounting), ``prepare`` and ``staleness`` (write once, when missing or
stale; append when the inputs only grew), ``parallel`` (the passes as Dask tasks) and
``append`` (new inputs as new shards). Public names are exported by :mod:`annbatch_torch`.
"""
