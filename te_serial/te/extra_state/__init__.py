"""Read and write Transformer Engine module ``_extra_state`` without ever unpickling it.

What TE stores
--------------
Every TE module (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``,
``DotProductAttention`` ...) puts an ``<prefix>_extra_state`` entry in its state dict
(``TransformerEngineBaseModule.get_extra_state`` in ``transformer_engine/pytorch/module/base.py``):

* ``torch.empty(0, dtype=torch.uint8)`` when FP8 is not in use or the recipe is stateless
  (``Float8CurrentScaling``, ``MXFP8BlockScaling``, ``Float8BlockScaling``, ``NVFP4BlockScaling``);
* otherwise a 1-D ``uint8`` tensor holding ``pickle.dumps(state)`` (default protocol, 4 on
  Python 3.8-3.13), where ``state`` is a dict::

      {"recipe": <transformer_engine.common.recipe.DelayedScaling instance>,
       "scale_fwd": fp32 CPU tensor, "amax_history_fwd": fp32 CPU tensor (amax_history_len, n),
       "scale_bwd": ..., "amax_history_bwd": ...,
       "extra_fp8_variables": {the bool/int/float/str/tuple/list entries of fp8_meta}}

  The recipe is pickled by reference to ``transformer_engine.common.recipe`` (``STACK_GLOBAL`` +
  ``NEWOBJ`` + ``BUILD`` of its ``__dict__``; the ``Format`` enum as ``REDUCE(Format,
  (NEWOBJ(_FormatHelper, (max_fwd, max_bwd)),))``). Each tensor is pickled as
  ``REDUCE(torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, requires_grad,
  REDUCE(collections.OrderedDict, ())))`` and each storage as
  ``REDUCE(torch.storage._load_from_bytes, (bytes,))`` -- the bytes being a complete *legacy*
  (non-zip) ``torch.save`` of that storage: five concatenated protocol-2 pickles (magic number,
  protocol version 1001, sys-info dict, the storage as a ``BINPERSID`` of
  ``("storage", torch.FloatStorage, key, location, numel, None)``, the list of keys), then per
  key an int64 little-endian element count and the raw little-endian bytes;
* TE 1.x wrote no ``recipe`` (and also ``scale_inv_fwd`` / ``scale_inv_bwd``), and before
  TE 2.0 (PR #1335) the value was an ``io.BytesIO`` holding ``torch.save(state)`` (zip format
  with ``archive/data.pkl`` + ``archive/data/<key>``; ``torch.save(None)`` when FP8 was off),
  whose tensors usually live on ``cuda:0``.

TE's own ``set_extra_state`` classifies the pickle with ``pickletools`` and refuses to
``pickle.loads`` a delayed-scaling (or unknown) payload unless
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` -- because unpickling executes whatever callables the
payload names.

Why we never unpickle
---------------------
A checkpoint is untrusted input. ``pickle.loads`` (and ``torch.load``, even with
``weights_only=True``, whose allow-list and parser have had bypasses) runs code chosen by the
file. This package instead walks the opcodes with :func:`pickletools.genops` -- a pure parser that
executes nothing -- and interprets them with a tiny stack machine that knows only the shapes TE
writes. No global is ever imported or called: an allowed ``GLOBAL`` becomes an inert marker,
and ``REDUCE`` / ``NEWOBJ`` / ``BUILD`` are accepted only for the exact (callable, arguments)
combinations above, each reimplemented here as plain data.

What is accepted
----------------
Opcodes: ``PROTO FRAME STOP MARK POP POP_MARK DUP``, ``NONE NEWTRUE NEWFALSE``, ``INT BININT
BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT``, ``UNICODE BINUNICODE SHORT_BINUNICODE
BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8``, ``EMPTY_LIST APPEND APPENDS LIST EMPTY_TUPLE
TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT DICT SETITEM SETITEMS``, the memo opcodes, ``GLOBAL
STACK_GLOBAL REDUCE NEWOBJ BUILD``, and ``BINPERSID`` inside ``torch.save`` payloads only.

Globals: ``torch._utils._rebuild_tensor_v2``, ``torch.storage._load_from_bytes`` (top level
only), ``collections.OrderedDict`` (only called with no arguments, as a tensor's empty
backward-hooks), ``torch.{Float,Half,BFloat16,Byte,Char,Short,Int,Long,Bool}Storage`` (only
inside ``torch.save`` persistent ids) and the recipe classes of
``transformer_engine.common.recipe`` (see :data:`RECIPE_CLASSES`, :data:`RECIPE_NAMEDTUPLES`,
``Format``).

Output: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``
and CPU ``torch.Tensor`` only. A recipe object becomes ``{"__class__": "DelayedScaling",
"fields": {...}}`` (namedtuples too, with their field names), an enum member becomes
``{"__enum__": "Format", "name": "HYBRID"}``.

Everything else -- an unknown global, a ``REDUCE`` of anything but the combinations above,
``INST``/``OBJ``/``NEWOBJ_EX``/``EXT*``/``PERSID``/buffers/sets/py2 strings, cycles, nesting
deeper than :data:`MAX_DEPTH`, storages that claim more bytes than present or more than
:data:`MAX_STORAGE_BYTES`, views with a negative or zero stride (on a dimension of size > 1),
overlapping views, views reaching past their storage, recipe fields that are not plain
identifiers (``__class__``, ``__reduce_ex__`` ...), zip payloads with compressed, encrypted or more
than :data:`MAX_ZIP_ENTRIES` entries, truncated or trailing data -- raises
:class:`UnsafeExtraStateError` (a :class:`~te_serial.errors.UnsupportedValueError`, so a
:class:`~te_serial.errors.CheckpointError`) naming what was refused and where. No other exception
class leaves :func:`decode_te_extra_state` for any input.

Bounds
------
All ``_extra_state`` entries of one checkpoint share one :class:`ExtraStateBudget`, made from
F = the checkpoint's size in bytes (the manifest plus every buffer file; for a single file, its
size):

* work -- pickle opcodes interpreted plus values checked, converted or rebuilt -- at most
  ``min(2,000,000, 65,536 + F / 4)`` steps for the whole checkpoint, and at most 262,144
  (:data:`MAX_PAYLOAD_WORK`) for the decoding of any one payload;
* bytes -- tensor and storage bytes materialized by the decoder, tensor copies and encoded
  payloads made while loading -- at most ``2 * F + 16 MiB`` for the whole checkpoint;
* one payload at most :data:`MAX_PAYLOAD_BYTES` (64 MiB), one storage at most
  :data:`MAX_STORAGE_BYTES` (64 MiB), a zip payload at most :data:`MAX_ZIP_ENTRIES` entries,
  stored (never compressed) and unencrypted; at most :data:`MAX_MEMO` memo entries,
  :data:`MAX_STACK` stack items, :data:`MAX_DEPTH` levels of nesting, ints of
  :data:`MAX_INT_BITS` bits.

A value decoded outside a checkpoint (``decode_te_extra_state(value)``, e.g. while saving)
gets a budget of its own with F = the payload's length. Past a bound the entry is refused with
:class:`UnsafeExtraStateError` before the memory is allocated. While one entry is encoded,
transient memory is a small multiple (about 4x) of that entry's tensor bytes.

:func:`encode_te_extra_state` is the inverse: it rebuilds real
``transformer_engine.common.recipe`` objects (so it needs TE's Python package importable) and
calls ``pickle.dumps`` exactly as ``get_extra_state`` does, so TE's ``set_extra_state`` reads the
result and, for the same state, the bytes equal TE's own except for the storage keys inside
the nested ``torch.save`` payloads (TE uses the storages' memory addresses). What it pickles is
only what it built itself -- plain values, CPU tensor copies, and instances of the installed TE's
recipe classes whose instance dicts hold such values under identifier, non-dunder names -- so
the result is not decoded again (a pure-Python re-check over bytes we produced ourselves would
only cost time in proportion to the payload). Where the installed TE (or its absence) cannot
express a valid state, it raises :class:`TEUnavailableError`; loading then returns the decoded
state with a warning.

Modules
-------
One job each; a module imports only those listed before it.

* :mod:`.errors` -- the two errors, and bounded reprs for their messages;
* :mod:`.limits` -- the ``MAX_*`` bounds named above and :class:`ExtraStateBudget`;
* :mod:`.schema` -- what TE's state is made of (:data:`RECIPE_CLASSES` ...) and the value rules;
* :mod:`.pickle_vm` -- the restricted stack machine and its inert markers;
* :mod:`.containers` -- the nested ``torch.save`` payloads (legacy by hand, zip with :mod:`zipfile`);
* :mod:`.plain` -- markers to plain values; tensors rebuilt from the raw storage bytes with
  ``torch.frombuffer`` + ``as_strided`` after bounds checks;
* :mod:`.check` -- the shape a decoded state may have (:func:`check_extra_state`);
* :mod:`.decode` / :mod:`.encode` -- the entry points.
"""

from .check import check_extra_state
from .decode import decode_te_extra_state, is_stateless_extra_state
from .encode import encode_te_extra_state, recipe_from_plain, recipe_to_plain
from .errors import TEUnavailableError, UnsafeExtraStateError
from .limits import MAX_PAYLOAD_WORK, MAX_ZIP_ENTRIES, ExtraStateBudget
from .schema import DELAYED_SCALING_KEYS, RECIPE_MODULE
