"""Sphinx configuration of the annbatch_torch documentation (``make docs``).

Pages are MyST markdown; tutorials are MyST notebooks (``{code-cell}``) that myst-nb runs at
build time on small generated data, so a page whose code breaks fails the build. The API
reference is generated from the numpy-style docstrings (autosummary + numpydoc).

Cross-references to Python, numpy, scipy, pandas, torch, anndata, zarr and Lightning go
through intersphinx. The build machine may have no network, so the inventories are local
files that ``docs/inventories.py`` writes from a table of the names these pages use (each
linked to its page on that project's site); ``ABT_DOCS_ONLINE=1`` reads the projects' own
published inventories instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import inventories  # noqa: E402  (docs/inventories.py)

import annbatch_torch  # noqa: E402

project = "annbatch_torch"
author = "annbatch_torch developers"
copyright = "2026, annbatch_torch developers"
release = annbatch_torch.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "numpydoc",
    "sphinx_copybutton",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md", "jupyter_execute"]
# .rst first: autosummary writes its stubs with the first suffix, and they are reST
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# -- MyST / notebooks -----------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3
nb_execution_mode = os.environ.get("ABT_DOCS_EXECUTE", "force")
nb_execution_timeout = 300
nb_execution_raise_on_error = True  # a page whose code breaks fails the build
nb_execution_show_tb = True
nb_merge_streams = True
# stderr of the cells is not shown: tqdm.auto's "IProgress not found" under a kernel without
# ipywidgets, Lightning's banners; a cell that raises still fails the build
nb_output_stderr = "remove"
nb_execution_in_temp = True  # pages write their generated inputs into a temporary folder
# the pages' kernels start from a profile of the build's own (no user startup files) that
# logs errors only: ipykernel warns at every start that jupyter_client's loopback TCP
# channels are unencrypted, which is noise on a build machine
_ipython = HERE / "_build" / "ipython"
(_ipython / "profile_default").mkdir(parents=True, exist_ok=True)
(_ipython / "profile_default" / "ipython_kernel_config.py").write_text(
    "c.IPKernelApp.log_level = 'ERROR'\n")
os.environ["IPYTHONDIR"] = str(_ipython)

# -- API reference ---------------------------------------------------------------------------
autosummary_generate = True
templates_path = ["_templates"]  # classes and modules documented whole, no member tables
autosummary_imported_members = True
autodoc_default_options = {"members": True, "inherited-members": False,
                           "show-inheritance": True}
autodoc_typehints = "none"  # numpydoc renders the documented types
autodoc_member_order = "bysource"
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
numpydoc_validation_checks: set[str] = set()

# -- cross-references ------------------------------------------------------------------------
nitpicky = True
nitpick_ignore_regex = [("py:class", r".*\._[A-Za-z]\w*")]  # private bases (show-inheritance)
nitpick_ignore = [("py:class", "abc.ABC")]  # EpochPlan's base: not in the stored Python inventory
intersphinx_mapping = inventories.mapping(HERE / "_inventories",
                                          online=os.environ.get("ABT_DOCS_ONLINE") == "1")
intersphinx_timeout = 10

# -- HTML --------------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = "annbatch_torch"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
# pages without children: no empty "Section Navigation" column
html_sidebars = {page: [] for page in (
    "index", "getting-started", "concepts", "remote", "scvi", "tuning", "benchmarks", "faq",
    "troubleshooting", "changelog", "format", "architecture", "guides/*")}
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_context = {"default_mode": "light"}


def _figures(app: object) -> None:
    """Figures drawn from the code when the site is built (docs/figures/*.py)."""
    from figures import epoch_deal

    out = HERE / "_generated"
    out.mkdir(exist_ok=True)
    epoch_deal.draw(out / "epoch_deal.png")


def _skip_reexported(app: object, what: str, name: str, obj: object, skip: bool,
                     options: object) -> bool | None:
    """Document a name once: members of a module page that the top-level package exports
    (``annbatch_torch.sampling.Sampler`` is ``annbatch_torch.Sampler``) are skipped there."""
    if what == "module" and getattr(annbatch_torch, name, None) is obj and obj is not None:
        return True
    return None


def setup(app: object) -> None:
    app.connect("builder-inited", _figures)  # type: ignore[attr-defined]
    app.connect("autodoc-skip-member", _skip_reexported)  # type: ignore[attr-defined]
