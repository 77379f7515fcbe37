"""Pools of rows read into memory and cut into batches: ``reader`` (a pool's rows, read
concurrently into place), ``scatter`` (rows copied to their places in a pool or a dense
batch, compiled),
``buffers`` (reused pool buffers), ``csr`` (CSR views, slices,
densifying), ``genes`` (a gene subset or a reference gene order, cut out of the columns),
``pool_stream`` (prefetch and the next epoch's read-ahead), ``host_pool`` and ``device_pool``
(a pool on the host or on a CUDA device, ``batch(lo, hi)``), ``gpu_backends`` (the device
pool's per-field storage on cupy or torch), ``densify`` (where sparse fields become dense),
``handoff`` (CSR keys from a DataLoader worker to the main process by reference to the
worker's shared pool memory), ``send_order`` (a plain DataLoader's workers send batches
densified on arrival in the loader's order). May import torch; never the writer or the face.
"""
