"""``annbatch-torch diversity``: the shuffle-quality report of a collection under loader
settings (:func:`~annbatch_torch.diversity.diversity_report`), printed, as JSON or plotted.
Reads obs only, never ``X``."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .args import CliError, CliParser, int_at_least

__all__ = ["add_diversity", "run_diversity", "parse_sampler"]

SAMPLER_HELP = ("chunked (the default: chunked mode, shuffled chunks mixed in pools), "
                "balanced:COL (ClassBalancedSampler over categorical obs column COL) or "
                "weighted:COL (WeightedSampler, per-row weights from numeric obs column COL)")


def parse_sampler(text: str) -> tuple[str, str | None]:
    """``--sampler`` as ``(kind, column)``: ``("chunked", None)``, ``("balanced", COL)`` or
    ``("weighted", COL)``."""
    kind, sep, column = text.partition(":")
    if kind == "chunked" and not sep:
        return "chunked", None
    if kind in ("balanced", "weighted") and sep and column:
        return kind, column
    raise argparse.ArgumentTypeError(f"{text!r}: give {SAMPLER_HELP}")


parse_sampler.__name__ = "sampler"  # argparse's "invalid sampler value"


def add_diversity(sub: Any, commands: dict[str, CliParser]) -> None:
    """Add the ``diversity`` subcommand to ``sub`` (the subparsers of the main parser)."""
    d = sub.add_parser(
        "diversity", help="how mixed a collection's batches are (obs only, X never read)",
        description="Report how mixed the batches of a collection are under loader settings, "
        "against truly random batches of the same epoch: per-batch entropy of an obs column "
        "(ratio 1: a perfect shuffle), distinct classes per batch, each class's share in the "
        "batches against its share in the epoch and in the collection. Reads the obs "
        "columns and the epoch plan only (annbatch_torch.diversity_report).",
    )
    commands["diversity"] = d
    d.add_argument("store", nargs="+", metavar="STORE",
                   help="a collection folder or s3:// URL, or AnnData inputs (.h5ad files / "
                        "zarr stores) as a dataset reads them in place")
    d.add_argument("--obs", action="append", required=True, metavar="COLUMN",
                   help="categorical (or integer / bool) obs column to report; give it again "
                        "for a second column, e.g. --obs cell_type --obs donor_id")
    d.add_argument("--sampler", type=parse_sampler, default=("chunked", None),
                   metavar="chunked|balanced:COL|weighted:COL", help=SAMPLER_HELP)
    d.add_argument("--chunk-size", type=int_at_least(1), metavar="N",
                   help="rows per chunk (default: AnnBatchDataset's)")
    d.add_argument("--preload-nchunks", type=int_at_least(1), metavar="N",
                   help="chunks per pool (default: AnnBatchDataset's)")
    d.add_argument("--batch-size", type=int_at_least(1), default=4096, metavar="N",
                   help="rows per batch (default: %(default)s)")
    d.add_argument("--n-batches", type=int_at_least(0), default=200, metavar="N",
                   help="batches of the epoch to judge, from its start; 0: the whole epoch "
                        "(default: %(default)s)")
    d.add_argument("--seed", type=int_at_least(0), default=0,
                   help="the loader's seed (default: %(default)s)")
    d.add_argument("--epoch", type=int_at_least(0), default=0,
                   help="the epoch to judge (default: %(default)s)")
    d.add_argument("--max-categories", type=int_at_least(0), default=10, metavar="N",
                   help="classes listed per column, the largest first (default: "
                        "%(default)s)")
    d.add_argument("--json", action="store_true",
                   help="print the report as JSON (summary and every class) instead")
    d.add_argument("--plot", type=Path, metavar="PNG",
                   help="also draw the report into this image (needs matplotlib)")
    d.set_defaults(func=run_diversity)


def _sampler(source: Any, kind: str, column: str | None) -> Any:
    import annbatch_torch as abt

    from ..diversity import column_values

    if kind == "chunked":
        return None
    assert column is not None
    if kind == "balanced":
        return abt.ClassBalancedSampler(column)
    name, info, values = column_values(source, column)
    if info.kind not in ("numeric", "bool"):
        raise CliError(f"--sampler weighted:{name}: {name!r} is a {info.kind} obs column; "
                       "weighted:COL takes per-row weights from a numeric obs column "
                       f"(balanced:{name} draws its classes equally often).")
    return abt.WeightedSampler(values.astype(np.float64))


def _number(value: Any) -> Any:
    if isinstance(value, float | np.floating):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value if isinstance(value, int | str | bool) or value is None else str(value)


def run_diversity(args: argparse.Namespace, parser: CliParser) -> int:
    import annbatch_torch as abt

    from ..diversity import diversity_report

    kind, column = args.sampler
    source = abt.open_source(args.store[0] if len(args.store) == 1 else args.store)
    sizes = {k: v for k, v in (("chunk_size", args.chunk_size),
                               ("preload_nchunks", args.preload_nchunks)) if v is not None}
    ds = abt.AnnBatchDataset(source, batch_size=args.batch_size, seed=args.seed,
                             sampler=_sampler(source, kind, column), rank=0, world_size=1,
                             **sizes)
    n_batches = args.n_batches or None
    columns = list(dict.fromkeys(args.obs))
    summary = diversity_report(ds, columns, n_batches, epoch=args.epoch)
    classes = diversity_report(ds, columns, n_batches, epoch=args.epoch, per="class")
    per_batch = (diversity_report(ds, columns, n_batches, epoch=args.epoch, per="batch")
                 if args.plot else None)
    mode = ("chunked mode" if kind == "chunked" else f"sampler {kind}:{column}")
    settings = (f"{mode}, batch_size={ds.batch_size}, chunk_size={ds.chunk_size}, "
                f"preload_nchunks={ds.preload_nchunks}, seed={ds.seed}, epoch={args.epoch}")
    if args.json:
        out = {
            "store": source.describe(), "settings": settings,
            "summary": {c: {k: _number(v) for k, v in row.items()}
                        for c, row in summary.to_dict(orient="index").items()},
            "classes": {c: [{"category": _number(cat),
                             **{k: _number(v) for k, v in row.items()}}
                            for cat, row in classes.loc[c].to_dict(orient="index").items()]
                        for c in columns},
        }
        print(json.dumps(out, indent=1))
    else:
        _print(source, settings, summary, classes, args.max_categories)
    if args.plot is not None:
        _plot(args.plot, settings, summary, classes, per_batch, args.max_categories)
        print(f"plot written to {args.plot}")
    return 0


def _print(source: Any, settings: str, summary: pd.DataFrame, classes: pd.DataFrame,
           limit: int) -> None:
    print(f"source      {source.describe()} ({source.n_obs:,} cells)")
    print(f"settings    {settings}")
    for name, row in summary.iterrows():
        print(f"\n{name}: {int(row['batches'])} batches, {int(row['rows']):,} rows, "
              f"{int(row['classes'])} classes in the epoch")
        print(f"  entropy per batch   {row['entropy']:.3f} nats, random batches "
              f"{row['random_entropy']:.3f}: ratio {row['entropy_ratio']:.3f} (least mixed "
              f"batch {row['entropy_ratio_min']:.3f}; 1 is a perfect shuffle)")
        print(f"  classes per batch   {row['distinct']:.1f}, random batches "
              f"{row['random_distinct']:.1f}: ratio {row['distinct_ratio']:.3f}")
        print(f"  share error         {row['share_error']:.4f} (total variation between the "
              "classes' shares in the batches and in the epoch)")
        if limit:
            table = classes.loc[name].sort_values("collection_cells", ascending=False)
            shown = table.head(limit)[["collection_share", "epoch_share", "batch_share",
                                       "in_batches", "random_in_batches"]]
            print(shown.to_string(float_format=lambda v: f"{v:.4f}"))
            if len(table) > limit:
                print(f"  ... (+{len(table) - limit} classes; --max-categories N shows more)")


def _plot(path: Path, settings: str, summary: pd.DataFrame, classes: pd.DataFrame,
          per_batch: pd.DataFrame | None, limit: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise CliError(f"--plot {path}: needs matplotlib (pip install matplotlib).") from e
    assert per_batch is not None
    names = list(summary.index)
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.4 * len(names)), squeeze=False)
    for (ax_b, ax_c), name in zip(axes, names):
        b = per_batch.loc[name]
        ax_b.plot(b.index, b["entropy_ratio"], lw=1)
        ax_b.axhline(1.0, color="grey", ls="--", lw=0.8)
        ax_b.set_ylim(0, max(1.1, float(np.nanmax(b["entropy_ratio"])) + 0.05))
        ax_b.set_xlabel("batch")
        ax_b.set_ylabel("entropy / random")
        ax_b.set_title(f"{name}: per-batch entropy ratio (mean "
                       f"{summary.loc[name, 'entropy_ratio']:.3f})", fontsize=9)
        c = classes.loc[name].sort_values("collection_cells", ascending=False).head(
            max(limit, 1))
        x = np.arange(len(c))
        for i, (col, label) in enumerate((("collection_share", "collection"),
                                          ("epoch_share", "epoch"),
                                          ("batch_share", "batches"))):
            ax_c.bar(x + (i - 1) * 0.27, c[col], width=0.27, label=label)
        ax_c.set_xticks(x, [str(v) for v in c.index], rotation=60, ha="right", fontsize=7)
        ax_c.set_ylabel("share of rows")
        ax_c.set_title(f"{name}: class shares (largest {len(c)})", fontsize=9)
        ax_c.legend(fontsize=7)
    fig.suptitle(settings, fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise CliError(f"--plot {path}: cannot write the image: {e.strerror or e}") from e
    finally:
        plt.close(fig)

