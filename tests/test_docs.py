"""The documentation site: the quickstart is the README's, every public name has its API
page, every page the site promises was built, and the inventories link to real sites.

``make test`` builds the site (``make docs``: warnings are errors, tutorial pages are
executed) before it runs these tests; the built-site checks read ``docs/_build/html``.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import pytest

import annbatch_torch as abt

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
HTML = DOCS / "_build" / "html"
PAGES = ["index", "getting-started", "concepts", "guides/dataloader", "guides/ddp-lightning",
         "guides/selectors", "guides/samplers", "remote", "guides/writer", "scvi",
         "guides/gpu", "guides/inplace", "tuning", "benchmarks", "faq", "troubleshooting",
         "api", "changelog", "format", "architecture"]


@pytest.fixture(scope="module")
def html() -> Path:
    if not (HTML / "index.html").exists():
        pytest.fail(f"{HTML} holds no built site: run `make docs` first (`make test` does)")
    return HTML


def test_the_quickstart_page_runs_the_readmes_code() -> None:
    readme = re.search(r"## Quickstart\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(),
                       re.S)
    page = re.search(r"## Quickstart\n.*?```\{code-cell\} python\n(.*?)```",
                     (DOCS / "getting-started.md").read_text(), re.S)
    assert readme is not None
    assert page is not None
    assert page.group(1) == readme.group(1)


def test_every_public_name_has_an_api_page(html: Path) -> None:
    names = [f"annbatch_torch.{n}" for n in abt.__all__]
    names.append("annbatch_torch.integrations.scvi.SCVIDataModule")
    missing = [n for n in names if not (html / "generated" / f"{n}.html").exists()]
    assert not missing, f"no API page for {missing}: add them to docs/api.md"
    page = (html / "generated" / "annbatch_torch.AnnBatchDataset.html").read_text()
    assert "batch_converter" in page
    assert "Parameters" in page


def test_every_public_callable_documents_its_parameters(html: Path) -> None:
    import inspect

    missing = []
    for name in abt.__all__:
        obj = getattr(abt, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or (
                inspect.isclass(obj) and issubclass(obj, BaseException)):
            continue
        params = [p for p in inspect.signature(obj).parameters if p != "self"]
        page = (html / "generated" / f"annbatch_torch.{name}.html").read_text()
        if params and "Parameters" not in page:
            missing.append(name)
    assert not missing, f"no Parameters section in the docstrings of {missing}"
    assert "Attributes" in (html / "generated" / "annbatch_torch.A.html").read_text()


def test_every_page_is_built_and_linked(html: Path) -> None:
    index = (html / "index.html").read_text()
    for page in PAGES:
        assert (html / f"{page}.html").exists(), page
        if page != "index":
            assert f'href="{page}.html' in index, f"{page} is not in the index's toctree"


def test_tutorial_pages_show_their_executed_output(html: Path) -> None:
    page = (html / "guides" / "dataloader.html").read_text()
    assert re.search(r"(\d+) rows, \1 distinct: every cell once", page)
    assert re.search(r"last loss \d", (html / "getting-started.html").read_text())


def test_the_epoch_figure_is_built(html: Path) -> None:
    images = list((html / "_images").glob("epoch_deal*.png"))
    assert images
    assert images[0].stat().st_size > 10_000


def test_local_inventories_link_to_the_projects_sites() -> None:
    import sys

    sys.path.insert(0, str(DOCS))
    try:
        import inventories
    finally:
        sys.path.remove(str(DOCS))
    for project, (root, entries) in inventories.TABLE.items():
        assert root.startswith("https://"), project
        assert root.endswith("/"), project
        for name, (role, uri) in entries.items():
            assert role in {"class", "function", "method", "module", "data", "exception",
                            "attribute"}, (project, name)
            assert not uri.startswith(("http", "/")), (project, name, uri)
    inv = (DOCS / "_inventories" / "numpy.inv")
    if inv.exists():  # written by the build: a valid zlib body with one line per name
        raw = inv.read_bytes()
        body = zlib.decompress(raw.split(b"zlib.\n", 1)[1]).decode()
        assert "numpy.ndarray py:class 1 reference/generated/numpy.ndarray.html" in body
