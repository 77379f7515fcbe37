"""Reading a collection from an S3-compatible server on loopback (moto), side by side with
the same server's front-to-back ceiling and the local collection.

    .venv/bin/python benchmarks/remote_read.py [--data benchmarks/data/grouped_100000x20000_seed0]
        [--workers 0,2] [--out benchmarks/results/remote_issue14_run.json]
        [--store NAME=PATH ...]      # several collections (e.g. two layouts), interleaved

One run: the benchmark collection (written locally once, cached under ``--data``) is
uploaded to a moto server started here, then for each worker count:

* ``ceiling``: every object of the collection read whole, front to back, by the same
  client (fsspec/s3fs, 16 objects at once): what this server delivers;
* ``epoch1``: an epoch of ``AnnBatchDataset`` (sparse X, batch 4096) from the server with an
  empty chunk cache;
* ``epoch2``: the next epochs (best of two), every chunk in the cache;
* ``local``: the same epoch from the local collection (best of two, page cache warm).

Ratios: epoch 1 against the ceiling (same bytes: an epoch reads every chunk once), epoch 2
against local. A Python server on loopback is not S3: it is CPU-bound on the same 2 CPUs as
the reader, with ~0.1 ms latency instead of S3's tens of ms, so the ratios measure our
overhead over what the server delivers, not S3 throughput.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import annbatch_torch as abt
from annbatch_torch import A
from annbatch_torch.store.remote.location import RemoteLocation
from annbatch_torch.write.upload import upload_collection

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import S3Server


def epoch(source: object, workers: int) -> tuple[float, int]:
    ds = abt.AnnBatchDataset(source, selector={"x": A.X}, batch_size=4096, seed=0)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    t0 = time.perf_counter()
    n = sum(b["x"].shape[0] for b in dl)
    return time.perf_counter() - t0, n


def ceiling(loc: RemoteLocation) -> tuple[float, int]:
    objects = loc.list()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:
        total = sum(ex.map(lambda k: len(loc.get(k)), objects))
    return time.perf_counter() - t0, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", default="benchmarks/data/grouped_100000x20000_seed0")
    p.add_argument("--workers", default="0,2")
    p.add_argument("--out", default="benchmarks/results/remote_issue14_run.json")
    p.add_argument("--store", action="append", default=[], metavar="NAME=PATH",
                   help="a local collection to upload and read (repeat for several, read in "
                        "turn for each worker count; default: DATA/collection)")
    args = p.parse_args()
    data = Path(args.data)
    stores = dict(s.split("=", 1) for s in args.store) or {"collection": str(data / "collection")}
    if not args.store and not (data / "collection" / "manifest.json").is_file():
        abt.create_anndata_collection(sorted(data.glob("part*.h5ad")), data / "collection",
                                      seed=0, obs_columns=["cell_type"])
    server = S3Server()
    results: dict[str, object] = {}
    try:
        urls = {}
        for k, (name, path) in enumerate(stores.items()):
            urls[name] = server.bucket(f"bench{k}") + "/atlas"
            t0 = time.perf_counter()
            upload_collection(Path(path), RemoteLocation(urls[name], server.options),
                              overwrite=False, progress=False)
            results[f"{name} upload_s"] = time.perf_counter() - t0
        for w, name in ((int(x), name) for x in args.workers.split(",") for name in stores):
            url, local = urls[name], Path(stores[name])
            loc = RemoteLocation(url, server.options)
            cache = Path(tempfile.mkdtemp(prefix="abt-bench-cache-"))
            try:
                coll = abt.open_collection(url, storage_options=server.options,
                                           cache_dir=cache)
                row = {}
                row["ceiling_s"], row["ceiling_bytes"] = ceiling(loc)
                row["epoch1_s"], n1 = epoch(coll, w)
                # warm cases: best of two epochs (the local one after a first read of it)
                row["epoch2_s"], n2 = min(epoch(coll, w), epoch(coll, w))
                local_coll = abt.open_collection(local)
                row["local_s"], n3 = min(epoch(local_coll, w), epoch(local_coll, w))
                row["cache_bytes"] = coll.mirror.cache.size()
                assert n1 == n2 == n3 == coll.n_obs, (n1, n2, n3)
                row["epoch1_vs_ceiling"] = row["ceiling_s"] / row["epoch1_s"]
                row["epoch2_vs_local"] = row["local_s"] / row["epoch2_s"]
                results[f"{name} workers={w}"] = row
                print(json.dumps({f"{name} workers={w}": row}), flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        server.stop()
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
