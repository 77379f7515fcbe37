"""Module-level hooks for ``tests/test_parallel_writer.py``: they must pickle by name into
Dask worker processes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


class SlowFirstBlock:
    """A ``value_check`` that, on its worker's first block, writes ``<folder>/started-<pid>``
    and sleeps ``seconds``: a window in which the test kills that worker mid-task."""

    def __init__(self, folder: str, seconds: float) -> None:
        self.folder, self.seconds = folder, seconds

    def __call__(self, label: str, field: str, block: Any) -> None:
        marker = Path(self.folder) / f"started-{os.getpid()}"
        if not marker.exists():
            marker.write_text(label)
            time.sleep(self.seconds)


class RejectInput:
    """A ``value_check`` refusing every block of inputs whose label contains ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, label: str, field: str, block: Any) -> None:
        if self.name in label:
            raise ValueError(f"{label}: {field} has values this test refuses")


class DieOnInput:
    """A ``value_check`` that kills its worker process (``os._exit``) on every block of
    inputs whose label contains ``name``: a worker that dies on every try of one input."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, label: str, field: str, block: Any) -> None:
        if self.name in label:
            os._exit(17)
