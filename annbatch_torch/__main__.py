"""``python -m annbatch_torch``: the ``annbatch-torch`` command (:func:`.cli.main`)."""

from __future__ import annotations

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
