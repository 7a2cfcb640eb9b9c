"""te-serial's error hierarchy: every failure a user can see is a TeSerialError."""

from __future__ import annotations


class TeSerialError(Exception):
    """Base class of every error te-serial raises on purpose."""


class FormatError(TeSerialError):
    """A quantizer, storage class or buffer set is not valid for its format."""


class ShapeError(FormatError, ValueError):
    """A tensor shape breaks a format's rule (e.g. MXFP8 needs dims divisible by 32)."""


class BufferMismatchError(FormatError):
    """Inner buffers disagree with what the quantizer describes (names, shapes, dtypes)."""


class UnknownQuantizerError(FormatError):
    """A quantizer kind that is not in te-serial's registry."""


class UnknownStorageError(FormatError):
    """A storage class name that is not in te-serial's storage registry."""


class QuantizationError(TeSerialError):
    """A quantizer cannot produce a reproducible result for this input or configuration."""


class UnsupportedOperationError(TeSerialError, NotImplementedError):
    """An operation that a quantized tensor cannot perform (e.g. in-place arithmetic)."""


class CheckpointError(TeSerialError):
    """A checkpoint could not be written or read; the message names file, tensor and field."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 field: str | None = None) -> None:
        where = ", ".join(f"{k}={v!r}" for k, v in (("file", file), ("tensor", tensor),
                                                    ("field", field)) if v is not None)
        super().__init__(f"{message} ({where})" if where else message)
        self.message, self.file, self.tensor, self.field = message, file, tensor, field


class ManifestError(CheckpointError):
    """The manifest is missing, unreadable, or breaks the schema or its own invariants."""


class VersionError(ManifestError):
    """The checkpoint was written by a newer major format version than this reader knows."""


class CheckpointFileError(CheckpointError):
    """A buffer file is missing, truncated, outside the checkpoint, or not valid safetensors."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint could not be written: not enough space (found before the first byte, or
    during a write), no permission, a read-only file system. It names the file and keeps the
    operating system's error (``__cause__``, ``errno``); an ``OSError`` too, as it always was.
    Nothing of the failed save is left behind, and the previous checkpoint is intact."""

    def __str__(self) -> str:  # the message that names the file, not OSError's "[Errno n] ..."
        return str(self.args[0]) if self.args else ""


class TensorMismatchError(CheckpointError):
    """A stored buffer disagrees with its prototype or with the file (shape, dtype, size, key)."""


class ChecksumError(CheckpointError):
    """A buffer's bytes do not match the checksum written at save time."""


class UnsupportedValueError(CheckpointError):
    """A state-dict value te-serial cannot store without pickle (the message names its path)."""


class ConversionError(CheckpointError):
    """A checkpoint cannot be converted as asked (the message names the file and tensor)."""


class UnknownLayoutError(ConversionError):
    """A checkpoint layout te-serial does not read (the message says what was found)."""
