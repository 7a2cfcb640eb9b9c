"""The one table of dtypes te-serial knows: torch dtype ↔ stable name ↔ safetensors code.

Names are resolved only through this table (never ``getattr(torch, name)``), so a file can name
nothing but these dtypes.
"""

from __future__ import annotations

import torch

from .errors import FormatError

#: stable name → (torch dtype, safetensors dtype code)
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "bool": (torch.bool, "BOOL"),
    "uint8": (torch.uint8, "U8"),
    "int8": (torch.int8, "I8"),
    "int16": (torch.int16, "I16"),
    "int32": (torch.int32, "I32"),
    "int64": (torch.int64, "I64"),
    "uint16": (torch.uint16, "U16"),
    "uint32": (torch.uint32, "U32"),
    "uint64": (torch.uint64, "U64"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float32": (torch.float32, "F32"),
    "float64": (torch.float64, "F64"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "float8_e8m0fnu": (torch.float8_e8m0fnu, "F8_E8M0"),
    "complex64": (torch.complex64, "C64"),
}

_BY_DTYPE = {dt: name for name, (dt, _) in _DTYPES.items()}

_BY_CODE = {code: dt for dt, code in _DTYPES.values()}


def dtype_name(dtype: torch.dtype) -> str:
    """Stable name of a torch dtype (``torch.float8_e4m3fn`` → ``"float8_e4m3fn"``)."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} is not supported by te-serial") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; refuses any name outside the table."""
    try:
        return _DTYPES[name][0]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype name {name!r}; known: {sorted(_DTYPES)}") from None


def safetensors_code(dtype: torch.dtype) -> str:
    """safetensors' dtype code for a torch dtype (``F8_E4M3``, ``BF16`` …)."""
    return _DTYPES[dtype_name(dtype)][1]


def dtype_from_code(code: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype code, or None for a code te-serial does not read."""
    return _BY_CODE.get(code)
