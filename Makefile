# Two set-up commands: `make demo` and `make test`. Both work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# test files marked `serial` (page-cache state): run alone, after the others
SERIAL := tests/test_io_gate.py

.PHONY: demo test test-fast lint docs bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,lightning,zarrs,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m annbatch_torch.cli demo

# compileall: the many test subprocesses then import our code from .pyc files, also where
# PYTHONDONTWRITEBYTECODE is set; --no-loadscope-reorder: conftest.py starts the slowest
# test files first
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory docs
	$(PY) -m compileall -q annbatch_torch benchmarks tests
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder -m "not serial"
	$(PY) -m pytest -q -p no:cacheprovider -m serial $(SERIAL)

# the quick loop: no docs build (so not its checks), no slow tests
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not serial" --ignore tests/test_docs.py

# the site, warnings as errors (nitpicky references included), tutorial pages executed
# (-j auto: pages are read, and their code run, in parallel)
docs: $(STAMP)
	rm -rf docs/_build docs/generated
	$(VENV)/bin/sphinx-build -q -W --keep-going -n -j auto -b html docs docs/_build/html

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache build dist docs/_build docs/generated docs/_generated docs/_inventories docs/jupyter_execute
