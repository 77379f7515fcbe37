"""``annbatch-torch diversity``: the shuffle-quality report of a collection under loader
settings (:func:`~annbatch_torch.diversity.diversity_report`), printed, as JSON or plotted.
Reads obs only, never ``X``."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from .args import CliError, CliParser, int_at_least

__all__ = ["add_diversity", "run_diversity", "parse_sampler", "SamplerSpec"]

SAMPLER_HELP = ("chunked (the default: chunked mode, shuffled chunks mixed in pools), "
                "balanced:COL (ClassBalancedSampler over categorical obs column COL; "
                "balanced:COL:N draws runs of N rows, balanced:COL:1 single rows; default: "
                "runs on a collection grouped by COL), weighted:COL (WeightedSampler, "
                "per-row weights from numeric obs column COL) or paired:COL:CONTROL"
                "[:MATCH,...] (PairedSampler: the perturbed rows of obs column COL, i.e. "
                "every value but CONTROL, each with a control row sharing the MATCH "
                "columns; the report counts the perturbed rows)")


class SamplerSpec(NamedTuple):
    """What ``--sampler`` asks for: ``kind`` (chunked, balanced, weighted, paired), the obs
    ``column``, a balanced sampler's ``run`` (rows per run, ``None``: its default), a
    paired sampler's ``control`` value and ``match`` columns."""

    kind: str
    column: str | None = None
    run: int | None = None
    control: str | None = None
    match: tuple[str, ...] = ()


def parse_sampler(text: str) -> SamplerSpec:
    """``--sampler`` as a :class:`SamplerSpec` (see :data:`SAMPLER_HELP`)."""
    kind, sep, rest = text.partition(":")
    if kind == "chunked" and not sep:
        return SamplerSpec("chunked")
    if kind == "paired":
        column, _, tail = rest.partition(":")
        control, _, match = tail.partition(":")
        names = tuple(m for m in match.split(",") if m) if match else ()
        if column and control and (not match or len(names) == len(match.split(","))):
            return SamplerSpec("paired", column, control=control, match=names)
    column, sep2, run = rest.rpartition(":") if kind == "balanced" and ":" in rest else (
        rest, "", "")
    if kind in ("balanced", "weighted") and sep and column:
        if not sep2:
            return SamplerSpec(kind, column)
        if run.isdigit() and int(run) >= 1:
            return SamplerSpec(kind, column, int(run))
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
    d.add_argument("--sampler", type=parse_sampler, default=SamplerSpec("chunked"),
                   metavar="chunked|balanced:COL|weighted:COL|paired:COL:CONTROL",
                   help=SAMPLER_HELP)
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
    d.add_argument("--no-shuffle", action="store_true",
                   help="judge an unshuffled loader (AnnBatchDataset(shuffle=False))")
    d.add_argument("--world-size", type=int_at_least(1), default=1, metavar="N",
                   help="ranks of the job (default: %(default)s)")
    d.add_argument("--rank", type=int_at_least(0), default=0, metavar="R",
                   help="the rank whose batches are judged (default: %(default)s)")
    d.add_argument("--max-categories", type=int_at_least(0), default=10, metavar="N",
                   help="classes listed per column, the largest first (default: "
                        "%(default)s)")
    d.add_argument("--json", action="store_true",
                   help="print the report as JSON (summary and every class) instead")
    d.add_argument("--plot", type=Path, metavar="PNG",
                   help="also draw the report into this image (needs matplotlib)")
    d.set_defaults(func=run_diversity)


def _sampler(source: Any, spec: SamplerSpec) -> Any:
    import annbatch_torch as abt

    from ..diversity import column_values
    from ..errors import AnnBatchError

    kind, column = spec.kind, spec.column
    if kind == "chunked":
        return None
    assert column is not None
    if kind == "balanced":
        return abt.ClassBalancedSampler(column,
                                        chunk_size="auto" if spec.run is None else spec.run)
    if kind == "paired":
        return abt.PairedSampler(column, spec.control, match=spec.match)
    name, info, values = column_values(source, column)
    if info.kind not in ("numeric", "bool"):
        raise CliError(f"--sampler weighted:{name}: {name!r} is a {info.kind} obs column; "
                       "weighted:COL takes per-row weights from a numeric obs column "
                       f"(balanced:{name} draws its classes equally often).")
    try:
        return abt.WeightedSampler(values.astype(np.float64))
    except AnnBatchError as e:
        raise CliError(f"--sampler weighted:{name}: obs column {name!r} cannot weigh rows: "
                       f"{e}") from None


def _number(value: Any) -> Any:
    if isinstance(value, float | np.floating):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value if isinstance(value, int | str | bool) or value is None else str(value)


def _plot_checked(path: Path) -> None:
    """Refuse a ``--plot`` that cannot be written before any work is done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise CliError(f"--plot {path}: needs matplotlib (pip install matplotlib).") from e
    kinds = FigureCanvasAgg(Figure()).get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in kinds:
        raise CliError(f"--plot {path}: give a file name ending in one of "
                       f"{', '.join('.' + k for k in sorted(kinds))} (e.g. report.png).")
    if not path.parent.is_dir():
        raise CliError(f"--plot {path}: the folder {path.parent} does not exist.")


def run_diversity(args: argparse.Namespace, parser: CliParser) -> int:
    import sys

    import annbatch_torch as abt

    from ..diversity import report_tables

    if args.rank >= args.world_size:
        raise CliError(f"--rank {args.rank}: give a rank below --world-size "
                       f"{args.world_size}.")
    if args.plot is not None:
        _plot_checked(args.plot)
    source = abt.open_source(args.store[0] if len(args.store) == 1 else args.store)
    sizes = {k: v for k, v in (("chunk_size", args.chunk_size),
                               ("preload_nchunks", args.preload_nchunks)) if v is not None}
    ds = abt.AnnBatchDataset(source, batch_size=args.batch_size, seed=args.seed,
                             sampler=_sampler(source, args.sampler), rank=args.rank,
                             world_size=args.world_size, shuffle=not args.no_shuffle,
                             **sizes)
    columns = list(dict.fromkeys(args.obs))
    tables = report_tables(ds, columns, args.n_batches or None, epoch=args.epoch)
    mode = "chunked mode" if ds.sampler is None else f"sampler {ds.sampler!r}"
    settings = (f"{mode}, batch_size={ds.batch_size}, chunk_size={ds.chunk_size}, "
                f"preload_nchunks={ds.preload_nchunks}, shuffle={ds.shuffle}, seed={ds.seed}, "
                f"epoch={args.epoch}"
                + (f", rank {args.rank} of {args.world_size}" if args.world_size > 1 else ""))
    if args.json:
        out = {
            "source": source.describe(), "settings": settings,
            "summary": {c: {k: _number(v) for k, v in row.items()}
                        for c, row in tables.summary.to_dict(orient="index").items()},
            "classes": {c: [{"category": _number(cat),
                             **{k: _number(v) for k, v in row.items()}}
                            for cat, row in zip(tables.classes.loc[c].index,
                                                tables.classes.loc[c].to_dict("records"))]
                        for c in tables.summary.index},
            "batches": {c: [{"batch": i, **{k: _number(v) for k, v in row.items()}}
                            for i, row in enumerate(tables.batches.loc[c].to_dict("records"))]
                        for c in tables.summary.index},
        }
        print(json.dumps(out, indent=1))
    else:
        _print(source, settings, tables.summary, tables.classes, args.max_categories)
    if args.plot is not None:
        _plot(args.plot, settings, tables.summary, tables.classes, tables.batches,
              args.max_categories)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _print(source: Any, settings: str, summary: pd.DataFrame, classes: pd.DataFrame,
           limit: int) -> None:
    print(f"source      {source.describe()} ({source.n_obs:,} cells)")
    print(f"settings    {settings}")
    for name, row in summary.iterrows():
        n_b, n_c = int(row["batches"]), int(row["classes"])
        table = classes.loc[name]
        missing = bool((pd.isna(table.index.to_series()).to_numpy()
                        & (table["collection_cells"].to_numpy() > 0)).any())
        print(f"\n{name}: {n_b} batch{'' if n_b == 1 else 'es'}, {int(row['rows']):,} rows, "
              f"{n_c} class{'' if n_c == 1 else 'es'} in the epoch (of "
              f"{int(row['collection_classes'])} in the collection"
              + (", missing values counted as one" if missing else "") + ")")
        print(f"  entropy per batch   {row['entropy']:.3f} nats, random batches "
              f"{row['random_entropy']:.3f}: ratio {row['entropy_ratio']:.3f} (least mixed "
              f"batch {row['entropy_ratio_min']:.3f}; 1 is a perfect shuffle)")
        print(f"  classes per batch   {row['distinct']:.1f}, random batches "
              f"{row['random_distinct']:.1f}: ratio {row['distinct_ratio']:.3f}")
        print(f"  share error         {row['share_error']:.4f} (total variation between the "
              "classes' shares in the batches and in the epoch)")
        if limit:
            table = table.sort_values("collection_cells", ascending=False)
            shown = table.head(limit)[["collection_share", "epoch_share", "batch_share",
                                       "in_batches", "random_in_batches"]]
            shown.index = ["(missing)" if pd.isna(v) else v for v in shown.index]
            print(shown.to_string(float_format=lambda v: f"{v:.4f}"))
            if len(table) > limit:
                print(f"  ... (+{len(table) - limit} classes; --max-categories N shows more)")


def _plot(path: Path, settings: str, summary: pd.DataFrame, classes: pd.DataFrame,
          per_batch: pd.DataFrame, limit: int) -> None:
    import matplotlib.pyplot as plt

    names = list(summary.index)
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.4 * len(names)), squeeze=False)
    for (ax_b, ax_c), name in zip(axes, names):
        b = per_batch.loc[name]
        ax_b.plot(b.index, b["entropy_ratio"], lw=1)
        ax_b.axhline(1.0, color="grey", ls="--", lw=0.8)
        finite = b["entropy_ratio"].to_numpy()
        finite = finite[np.isfinite(finite)]
        ax_b.set_ylim(0, max(1.1, float(finite.max()) + 0.05 if finite.size else 1.1))
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
        ax_c.set_xticks(x, ["(missing)" if pd.isna(v) else str(v) for v in c.index],
                        rotation=60, ha="right", fontsize=7)
        ax_c.set_ylabel("share of rows")
        ax_c.set_title(f"{name}: class shares (largest {len(c)})", fontsize=9)
        ax_c.legend(fontsize=7)
    fig.suptitle(settings, fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110, format=path.suffix.lower().lstrip("."))
    except OSError as e:
        raise CliError(f"--plot {path}: cannot write the image: {e.strerror or e}") from e
    finally:
        plt.close(fig)

