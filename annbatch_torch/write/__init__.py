"""The offline shuffle; no torch. From the entry points down:

``prepare`` (write once, when missing or stale; append when the inputs only grew) and
``staleness`` (is a collection current for its inputs?), ``append`` (new inputs as new shards),
``writer`` (``create_anndata_collection``), ``parallel`` (the passes as Dask tasks), ``passes``
(pass 1 routes rows into buckets, pass 2 writes a shard from its buckets), ``grouping``
(``group_by``: each shard's rows sorted by a class column), ``remap`` (a
block's genes in the collection's order, in one compiled loop), ``budget`` (the
``max_memory`` accounting), ``shardstore`` (a shard's zarr arrays, written block by block),
``schema`` (the fields a collection stores), ``narrow`` (the stored dtype of their values and
column indices, from what pass 1 saw) and ``varmeta`` (its var frame), ``buckets`` (pass
1's bucket file format), ``publish`` (temporaries, fsync, the swap into place, the writers'
lock), ``upload`` (a collection written to an object store). Public names are exported by
:mod:`annbatch_torch`.
"""
