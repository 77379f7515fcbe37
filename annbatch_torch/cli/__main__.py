"""``python -m annbatch_torch.cli``: the ``annbatch-torch`` command (:func:`.main.main`)."""

from __future__ import annotations

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
