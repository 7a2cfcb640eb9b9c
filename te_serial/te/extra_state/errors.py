"""The errors the extra-state codec raises, and the bounded repr their messages quote values with
(a hostile value may be megabytes long, so a message never holds its full repr)."""

from __future__ import annotations

import reprlib
from typing import Any, Optional

from ...errors import UnsupportedValueError


class UnsafeExtraStateError(UnsupportedValueError):
    """A TE ``_extra_state`` payload uses something the restricted decoder refuses (or is malformed)."""


class TEUnavailableError(UnsupportedValueError):
    """A valid extra state that the installed Transformer Engine cannot express as TE's bytes:
    its recipe module is not importable, or lacks a class, enum member or field layout the state
    names. Loading returns the decoded state with a warning instead."""


class _ShortRepr(reprlib.Repr):
    """reprlib that never builds the full repr of a large bytes / str value first."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 60, 60, 60
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 6

    def repr_bytes(self, x, level):
        return repr(bytes(x[:40])) + (f"...({len(x)} bytes)" if len(x) > 40 else "")

    repr_bytearray = repr_bytes


_SHORT = _ShortRepr()


def short_repr(obj: Any) -> str:
    """A bounded repr for error messages (a hostile value may be megabytes long)."""
    try:
        return _SHORT.repr(obj)
    except Exception:  # pylint: disable=broad-except  # a repr is never worth an escaping error
        return f"<{type(obj).__name__}>"


def unsafe_error(msg: str, where: Optional[str]) -> UnsafeExtraStateError:
    return UnsafeExtraStateError(f"TE extra state: {msg}", tensor=where)
