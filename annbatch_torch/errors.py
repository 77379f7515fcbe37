"""Exceptions raised by annbatch_torch.

Every message names the file, the field or the argument at fault and says what to do.
All of them subclass :class:`ValueError` so generic handlers keep working.
"""

from __future__ import annotations

import contextlib
import operator

import numpy as np

__all__ = [
    "AnnBatchError", "CollectionError", "InputError", "SchemaError", "ReadError", "BatchError",
    "SamplerError", "check_bool", "check_int",
]


def check_int(name: str, value: object, minimum: int, *,
              error: type[Exception] = ValueError, note: str = "",
              maximum: int | None = None, maximum_text: str | None = None) -> int:
    """``value`` as an ``int`` when it is an integer ``>= minimum`` (and ``<= maximum``),
    else ``error``.

    Parameters
    ----------
    name
        The argument's name, as the message gives it.
    value
        An ``int``, a numpy integer or anything with ``__index__``; ``bool`` (also
        ``numpy.bool_``) is refused.
    minimum
        The smallest value allowed.
    error
        The exception class raised (``ValueError``; e.g. :class:`SamplerError`).
    note
        Text after the bound in the message (e.g. ``" (or None)"``).
    maximum
        The largest value allowed (``None``: no upper bound).
    maximum_text
        How the message writes ``maximum`` and why it bounds (e.g. ``"2**62 (an int64
        position)"``; default its digits); ``note`` follows it.

    Raises
    ------
    Exception
        ``error("{name} must be an integer >= {minimum}{note}, got {value!r}.")``; above a
        ``maximum``, ``"{name} must be an integer <= {maximum}{note}, got {value!r}."``.
    """
    out = None
    if not isinstance(value, bool | np.bool_):
        with contextlib.suppress(TypeError):
            out = operator.index(value)  # type: ignore[arg-type]
    if out is None or out < minimum:
        raise error(f"{name} must be an integer >= {minimum}{note}, got {value!r}.")
    if maximum is not None and out > maximum:
        raise error(f"{name} must be an integer <= {maximum_text or maximum}{note}, got "
                    f"{value!r}.")
    return out


def check_bool(name: str, value: object) -> bool:
    """``value`` as a ``bool`` when it is one (``bool``, ``numpy.bool_``, or the integers 0
    and 1), else a ``TypeError`` naming ``name``: ``bool("no")`` is true, and a string
    given for a flag would otherwise be taken as ``True`` without a word."""
    if isinstance(value, bool | np.bool_) or (
            isinstance(value, int | np.integer) and int(value) in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}.")


class AnnBatchError(ValueError):
    """Base class of every error raised by annbatch_torch."""


class CollectionError(AnnBatchError):
    """A path is not a finished, valid collection (missing/damaged manifest or shards)."""


class InputError(AnnBatchError):
    """An input AnnData (file or object) cannot be used as given."""


class SchemaError(AnnBatchError, KeyError):
    """A selector names a field the source does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ReadError(AnnBatchError):
    """Reading a row range from a shard failed (damaged chunk, vanished file)."""


class BatchError(AnnBatchError):
    """Building a batch failed: a field's transform or the ``batch_converter`` raised, or
    a transform returned another number of rows than it was given.

    The message names the selector key, the field and the shards and rows of the pool the
    batch came from, plus the original exception's type and message (a DataLoader worker's
    error reaches the training loop re-raised from its text and traceback).
    """


class SamplerError(AnnBatchError):
    """A sampler's arguments do not fit the source (weights, rows, columns, sizes)."""
