"""te_serial.te.extra_state: TE module ``_extra_state`` decoded without unpickling, and re-encoded.

Payloads are made here exactly as TE makes them: ``pickle.dumps`` of the dict that
``TransformerEngineBaseModule.get_extra_state`` builds (TE's own recipe classes, via the CPU
shim), ``torch.save`` into an ``io.BytesIO`` for TE 1.x, and the empty uint8 tensor for
stateless modules. Malicious pickles must be refused without their callables ever running and
without ``pickle.loads`` / ``torch.load`` ever being reached.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import importlib
import io
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import types
import zipfile
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch

import te_shim
from helpers import same_bits
from te_serial.errors import CheckpointError, UnsupportedValueError
from te_serial.te.extra_state import (DELAYED_SCALING_KEYS, RECIPE_MODULE, UnsafeExtraStateError,
                                      decode_te_extra_state, encode_te_extra_state,
                                      is_stateless_extra_state, recipe_from_plain,
                                      recipe_to_plain)

LEGACY_PREFIX = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."


# --------------------------------------------------------------------------- TE's recipe module


def _stand_in_recipe_module() -> types.ModuleType:
    """Only where TE's wheel is missing: the recipe classes, pickled under TE's module name."""
    mod = types.ModuleType(RECIPE_MODULE)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E2M1 = _FormatHelper(6, 6)
        E4M3 = _FormatHelper(448, 448)
        E5M2 = _FormatHelper(57344, 57344)
        HYBRID = _FormatHelper(448, 57344)

    class Recipe:
        pass

    @dataclasses.dataclass(frozen=True)
    class MMParams:
        use_split_accumulator: bool = True

    @dataclasses.dataclass
    class DelayedScaling(Recipe):
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"
        scaling_factor_compute_algo: object = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False
        backward_override: object = None

    @dataclasses.dataclass
    class Float8CurrentScaling(Recipe):
        fp8_format: Format = Format.HYBRID
        fp8_gemm_fprop: MMParams = MMParams(False)

    for cls in (_FormatHelper, Format, Recipe, MMParams, DelayedScaling, Float8CurrentScaling):
        cls.__module__ = RECIPE_MODULE
        cls.__qualname__ = cls.__name__
        setattr(mod, cls.__name__, cls)
    return mod


_TE = te_shim.install()
if _TE is not None:
    import transformer_engine.common.recipe as R  # noqa: E402  (importable once the shim is in)
    import transformer_engine.pytorch._extra_state as TE_EXTRA_STATE  # noqa: E402
else:  # pragma: no cover - only without the test extra
    R = sys.modules.setdefault(RECIPE_MODULE, _stand_in_recipe_module())
    TE_EXTRA_STATE = None

needs_te = pytest.mark.skipif(TE_EXTRA_STATE is None, reason="transformer-engine wheel not installed")


# --------------------------------------------------------------------------- payloads as TE makes them


class _Meta:
    """A stand-in for TE's ``FP8TensorMeta`` (``scale`` + ``amax_history``)."""

    def __init__(self, n: int, history: int, gen: torch.Generator) -> None:
        self.scale = torch.rand(n, generator=gen) * 100
        self.amax_history = torch.rand(history, n, generator=gen) * 448


def _fp8_meta(recipe, *, num_gemms: int = 1, history: int = 1024, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    fwd, bwd = _Meta(3 * num_gemms, history, gen), _Meta(2 * num_gemms, history, gen)
    fwd.amax_history[0, 0] = float("nan")  # values TE never produces still survive bit-exactly
    fwd.amax_history[1, 1] = float("inf")
    fwd.scale[-1] = -0.0
    return {
        "recipe": recipe, "scaling_fwd": fwd, "scaling_bwd": bwd, "fp8_checkpoint": True,
        "fp8_group": object(), "num_gemms": num_gemms, "first_module": False,
        "autocast_id_fwd": 7, "autocast_id_fwd_stack": [7, 8], "fp8_max_fwd": 448.0,
        "fp8_max_bwd": 57344.0, "name": "decoder.layers.0.fc1", "shape": (128, 256),
        "nested": [(1, 2.5, "x", True), [None, -3]], "buffer_index_and_autocast_key": (0, 1),
        "global_fp8_buffer_pos_fwd_recompute": 3,
    }


def te_get_extra_state(fp8_meta: dict) -> torch.Tensor:
    """``TransformerEngineBaseModule.get_extra_state`` (TE 2.x), minus the CUDA sync."""

    def to_cpu(src):
        dst = torch.empty_like(src, device="cpu")
        dst.copy_(src, non_blocking=True)
        return dst

    state = {"recipe": fp8_meta["recipe"]}
    state["scale_fwd"] = to_cpu(fp8_meta["scaling_fwd"].scale)
    state["amax_history_fwd"] = to_cpu(fp8_meta["scaling_fwd"].amax_history)
    state["scale_bwd"] = to_cpu(fp8_meta["scaling_bwd"].scale)
    state["amax_history_bwd"] = to_cpu(fp8_meta["scaling_bwd"].amax_history)
    extra = {}
    for k, v in fp8_meta.items():
        if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str, tuple, list)):
            extra[k] = v
    state["extra_fp8_variables"] = extra
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def te1x_state(fp8_meta: dict) -> dict:
    """TE 1.x's state dict: no recipe, plus ``scale_inv_*``."""
    extra = {k: v for k, v in fp8_meta.items()
             if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str, tuple, list))}
    fwd, bwd = fp8_meta["scaling_fwd"], fp8_meta["scaling_bwd"]
    return {"scale_fwd": fwd.scale, "scale_inv_fwd": 1 / fwd.scale, "amax_history_fwd": fwd.amax_history,
            "scale_bwd": bwd.scale, "scale_inv_bwd": 1 / bwd.scale, "amax_history_bwd": bwd.amax_history,
            "extra_fp8_variables": extra}


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def payload_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def structure(data: bytes) -> list:
    """A payload's opcodes and arguments, with the nested ``torch.save`` storage keys (memory
    addresses, different in every process) and frame lengths left out."""
    out = []
    for op, arg, _pos in pickletools.genops(data):
        if op.name == "FRAME":
            continue
        if isinstance(arg, bytes) and arg.startswith(LEGACY_PREFIX):
            f, parts = io.BytesIO(arg), []
            for _ in range(5):
                parts.append(tuple((o.name, "<key>" if isinstance(a, str) and a.isdigit() else a)
                                   for o, a, _ in pickletools.genops(f)))
            parts.append(f.read())
            arg = tuple(parts)
        out.append((op.name, arg))
    return out


def globals_of(data: bytes) -> set:
    """The module.name of every GLOBAL / STACK_GLOBAL (memoized names followed through the memo)."""
    found, recent, memo = set(), [], {}
    for op, arg, _pos in pickletools.genops(data):
        if op.name == "MEMOIZE":
            memo[len(memo)] = recent[-1]
        elif op.name in ("BINPUT", "LONG_BINPUT"):
            memo[arg] = recent[-1]
        elif op.name in ("BINGET", "LONG_BINGET"):
            recent.append(memo.get(arg))
        elif op.name == "STACK_GLOBAL":
            found.add(f"{recent[-2]}.{recent[-1]}")
            recent.append(None)
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
            recent.append(None)
        else:
            recent.append(arg if isinstance(arg, str) else None)
    return found


def assert_same_state(got, want) -> None:
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.device.type == "cpu" and same_bits(got, want), (got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same_state(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_state(a, b)
    else:
        assert got == want or (got != got and want != want)


# --------------------------------------------------------------------------- guards


class _Called(Exception):
    pass


@contextlib.contextmanager
def no_code_execution(monkeypatch):
    """Every unpickler and every callable a malicious payload names raises and is recorded."""
    calls = []

    def trap(name):
        def _trap(*args, **kwargs):
            calls.append(name)
            raise _Called(name)
        return _trap

    with monkeypatch.context() as m:
        for mod, attr in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                          (torch, "load"), (torch.serialization, "load"),
                          (torch.serialization, "_legacy_load"), (torch.serialization, "_load"),
                          (torch.storage, "_load_from_bytes"), (os, "system"),
                          (sys.modules[os.system.__module__], "system"), (subprocess, "Popen"),
                          (subprocess, "check_output"), (builtins, "eval"), (importlib, "import_module")]:
            m.setattr(mod, attr, trap(f"{getattr(mod, '__name__', mod)}.{attr}"))
        yield calls
    assert calls == [], f"decode called {calls}"


def decode_guarded(monkeypatch, value):
    with no_code_execution(monkeypatch):
        return decode_te_extra_state(value)


def refused(monkeypatch, value, *needles):
    with no_code_execution(monkeypatch):
        with pytest.raises(UnsafeExtraStateError) as info:
            decode_te_extra_state(value, where="layer._extra_state")
    err = info.value
    assert isinstance(err, UnsupportedValueError) and isinstance(err, CheckpointError)
    msg = str(err)
    assert "layer._extra_state" in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


# --------------------------------------------------------------------------- stateless


def test_stateless_values(monkeypatch):
    empty = torch.empty(0, dtype=torch.uint8)
    for value in (None, empty, b"", io.BytesIO()):
        assert decode_guarded(monkeypatch, value) is None
        assert is_stateless_extra_state(value)
    enc = encode_te_extra_state(None)
    assert enc.dtype == torch.uint8 and enc.numel() == 0
    buf = io.BytesIO()
    torch.save(None, buf)  # TE 1.x with FP8 off
    assert decode_guarded(monkeypatch, buf) is None and is_stateless_extra_state(buf)
    assert decode_guarded(monkeypatch, as_tensor(pickle.dumps(None))) is None


# --------------------------------------------------------------------------- TE 2.x payloads


def test_te_payload_shape():
    """What TE writes: protocol 4, these globals only, tensors via nested legacy torch.save."""
    data = payload_bytes(te_get_extra_state(_fp8_meta(R.DelayedScaling())))
    ops = {op.name for op, _a, _p in pickletools.genops(data)}
    assert data[:2] == b"\x80" + bytes([pickle.DEFAULT_PROTOCOL])
    assert globals_of(data) == {
        f"{RECIPE_MODULE}.DelayedScaling", f"{RECIPE_MODULE}.Format", f"{RECIPE_MODULE}._FormatHelper",
        "torch._utils._rebuild_tensor_v2", "torch.storage._load_from_bytes", "collections.OrderedDict"}
    assert {"STACK_GLOBAL", "NEWOBJ", "BUILD", "REDUCE", "BINBYTES"} <= ops
    nested = [a for _o, a, _p in pickletools.genops(data) if isinstance(a, bytes)]
    assert len(nested) == 4 and all(n.startswith(LEGACY_PREFIX) for n in nested)
    assert b"ctorch\nFloatStorage\n" in nested[0]


def test_decode_delayed_scaling(monkeypatch):
    recipe = R.DelayedScaling(margin=2, fp8_format=R.Format.E4M3, amax_history_len=1024,
                              amax_compute_algo="most_recent", reduce_amax=False)
    meta = _fp8_meta(recipe, num_gemms=1)
    state = decode_guarded(monkeypatch, te_get_extra_state(meta))
    assert list(state) == ["recipe", *DELAYED_SCALING_KEYS, "extra_fp8_variables"]
    plain = state["recipe"]
    assert plain["__class__"] == "DelayedScaling"
    fields = plain["fields"]
    assert fields["margin"] == 2 and fields["amax_history_len"] == 1024
    assert fields["fp8_format"] == {"__enum__": "Format", "name": "E4M3"}
    assert fields["amax_compute_algo"] == "most_recent" and fields["reduce_amax"] is False
    assert fields["scaling_factor_compute_algo"] is None
    for key, src in (("scale_fwd", meta["scaling_fwd"].scale),
                     ("amax_history_fwd", meta["scaling_fwd"].amax_history),
                     ("scale_bwd", meta["scaling_bwd"].scale),
                     ("amax_history_bwd", meta["scaling_bwd"].amax_history)):
        t = state[key]
        assert type(t) is torch.Tensor and t.dtype == torch.float32 and t.is_contiguous()
        assert same_bits(t, src), key
    assert state["amax_history_fwd"].shape == (1024, 3) and state["amax_history_bwd"].shape == (1024, 2)
    extra = state["extra_fp8_variables"]
    assert extra == {k: v for k, v in meta.items() if k in (
        "fp8_checkpoint", "num_gemms", "first_module", "autocast_id_fwd", "autocast_id_fwd_stack",
        "fp8_max_fwd", "fp8_max_bwd", "name", "shape", "nested", "global_fp8_buffer_pos_fwd_recompute")}
    assert type(extra["shape"]) is tuple and type(extra["nested"][0]) is tuple
    assert not is_stateless_extra_state(te_get_extra_state(meta))


def test_round_trip_is_te_bytes(monkeypatch):
    """decode → encode gives TE's own bytes (up to storage keys) and decodes to the same state."""
    meta = _fp8_meta(R.DelayedScaling(margin=1), num_gemms=4, seed=3)
    original = te_get_extra_state(meta)
    state = decode_guarded(monkeypatch, original)
    encoded = encode_te_extra_state(state)
    assert encoded.dtype == torch.uint8 and encoded.dim() == 1
    assert structure(payload_bytes(encoded)) == structure(payload_bytes(original))
    again = decode_guarded(monkeypatch, encoded)
    assert_same_state(again, state)
    assert state["amax_history_fwd"].shape == (1024, 12)


def test_round_trip_every_recipe_class(monkeypatch):
    """Recipes also sit in extra_fp8_variables (DotProductAttention's ``local_recipes``)."""
    names = ["DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
             "NVFP4BlockScaling", "MMParams", "QParams"]
    recipes = [getattr(R, n)() for n in names if hasattr(R, n)]
    repr(recipes[0])  # populates the cached repr, which TE then pickles too
    meta = _fp8_meta(recipes[0], history=16)
    meta["local_recipes"] = recipes
    original = te_get_extra_state(meta)
    state = decode_guarded(monkeypatch, original)
    locals_ = state["extra_fp8_variables"]["local_recipes"]
    assert [r["__class__"] for r in locals_] == [type(r).__name__ for r in recipes]
    assert locals_[0] == state["recipe"]
    encoded = encode_te_extra_state(state)
    assert structure(payload_bytes(encoded)) == structure(payload_bytes(original))
    rebuilt = recipe_from_plain(locals_)
    assert [type(r) for r in rebuilt] == [type(r) for r in recipes]
    assert all(a == b for a, b in zip(rebuilt, recipes))
    assert recipe_to_plain(recipes) == locals_


def test_older_te_recipe_namedtuple(monkeypatch):
    """TE <= 2.x DelayedScaling carried ``override_linear_precision`` (a recipe-module NamedTuple)."""

    class _OverrideLinearPrecision(NamedTuple):
        fprop: bool = False
        dgrad: bool = False
        wgrad: bool = False

    _OverrideLinearPrecision.__module__ = RECIPE_MODULE
    _OverrideLinearPrecision.__qualname__ = "_OverrideLinearPrecision"
    monkeypatch.setattr(R, "_OverrideLinearPrecision", _OverrideLinearPrecision, raising=False)
    recipe = R.DelayedScaling()
    recipe.__dict__["override_linear_precision"] = _OverrideLinearPrecision(False, False, True)
    original = te_get_extra_state(_fp8_meta(recipe, history=8))
    state = decode_guarded(monkeypatch, original)
    assert state["recipe"]["fields"]["override_linear_precision"] == {
        "__class__": "_OverrideLinearPrecision", "fields": {"fprop": False, "dgrad": False, "wgrad": True}}
    assert structure(payload_bytes(encode_te_extra_state(state))) == structure(payload_bytes(original))
    monkeypatch.delattr(R, "_OverrideLinearPrecision")  # a TE without it refuses, as pickle would
    with pytest.raises(UnsupportedValueError, match="does not exist in the installed"):
        encode_te_extra_state(state)


def test_encode_accepts_real_recipe_and_refuses_callables():
    meta = _fp8_meta(R.DelayedScaling(), history=8)
    state = decode_te_extra_state(te_get_extra_state(meta))
    state["recipe"] = R.DelayedScaling()  # a real object is fine too
    assert structure(payload_bytes(encode_te_extra_state(state))) == \
        structure(payload_bytes(te_get_extra_state(meta)))
    with pytest.raises(UnsupportedValueError, match="cannot be stored without pickle"):
        encode_te_extra_state({**state, "recipe": R.DelayedScaling(amax_compute_algo=max)})
    with pytest.raises(UnsupportedValueError, match="object"):
        encode_te_extra_state({**state, "extra_fp8_variables": {"x": object()}})
    with pytest.raises(UnsupportedValueError, match="unknown recipe class"):
        encode_te_extra_state({**state, "recipe": {"__class__": "Popen", "fields": {}}})


@needs_te
def test_te_accepts_encoded_payload(monkeypatch):
    """TE's own classifier + loader path (``set_extra_state``) on what we encode."""
    recipe = R.DelayedScaling(margin=3)
    meta = _fp8_meta(recipe, history=32)
    original = te_get_extra_state(meta)
    encoded = encode_te_extra_state(decode_te_extra_state(original))
    data = payload_bytes(encoded)
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    with pytest.raises(RuntimeError, match="Refusing to load pickled"):  # why te-serial exists
        TE_EXTRA_STATE.should_load_extra_state_pickle(data, "Linear")
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    assert TE_EXTRA_STATE.should_load_extra_state_pickle(data, "Linear") is True
    loaded = pickle.loads(data)  # what TE does next (trusted here: we just wrote it)
    assert type(loaded["recipe"]) is R.DelayedScaling and loaded["recipe"] == recipe
    assert loaded["recipe"].fp8_format is R.Format.HYBRID
    for key in DELAYED_SCALING_KEYS:
        assert same_bits(loaded[key], pickle.loads(payload_bytes(original))[key])
    assert loaded["extra_fp8_variables"]["autocast_id_fwd_stack"] == [7, 8]


# --------------------------------------------------------------------------- TE 1.x payloads


def test_te1x_pickle_without_recipe(monkeypatch):
    meta = _fp8_meta(None, history=64)
    want = te1x_state(meta)
    original = as_tensor(pickle.dumps(want))  # TE 1.x under ONNX export
    state = decode_guarded(monkeypatch, original)
    assert state["recipe"] is None
    assert list(state) == ["recipe", *want]
    assert_same_state({k: v for k, v in state.items() if k != "recipe"}, want)
    encoded = encode_te_extra_state(state)  # recipe None → left out, as TE 1.x wrote it
    assert structure(payload_bytes(encoded)) == structure(payload_bytes(original))
    assert not is_stateless_extra_state(original)


@pytest.mark.parametrize("zip_format", [True, False])
def test_te1x_bytesio(monkeypatch, zip_format):
    meta = _fp8_meta(None, history=64, seed=5)
    want = te1x_state(meta)
    buf = io.BytesIO()
    torch.save(want, buf, _use_new_zipfile_serialization=zip_format)
    buf.seek(17)  # TE seeks to 0 itself; position must not matter
    state = decode_guarded(monkeypatch, buf)
    assert state["recipe"] is None
    assert_same_state({k: v for k, v in state.items() if k != "recipe"}, want)
    assert_same_state(decode_guarded(monkeypatch, buf.getvalue()), state)  # raw bytes too
    assert not is_stateless_extra_state(buf)
    assert_same_state(decode_guarded(monkeypatch, encode_te_extra_state(state)), state)


def test_te1x_bytesio_cuda_tensors_load_on_cpu(monkeypatch):
    """TE 1.x saved its CUDA meta tensors; their bytes are location-independent."""
    want = {"scale_fwd": torch.arange(3, dtype=torch.float32), "extra_fp8_variables": {}}
    buf = io.BytesIO()
    torch.save(want, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            blob = src.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"X\x03\x00\x00\x00cpu" in blob
                blob = blob.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            dst.writestr(info.filename, blob)
    state = decode_guarded(monkeypatch, io.BytesIO(out.getvalue()))
    assert state["scale_fwd"].device.type == "cpu" and same_bits(state["scale_fwd"], want["scale_fwd"])


def test_tensor_dtypes_and_views(monkeypatch):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    values = {"bf16": torch.randn(5).to(torch.bfloat16), "f16": torch.randn(2, 3).half(),
              "i8": torch.tensor([-1, 2], dtype=torch.int8), "i64": torch.tensor([1 << 40]),
              "u8": torch.tensor([255], dtype=torch.uint8), "b": torch.tensor([True, False]),
              "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5),
              "view": base[1:, ::2], "t": base.t()}
    state = decode_guarded(monkeypatch, as_tensor(pickle.dumps({"extra_fp8_variables": {}, **values})))
    for k, v in values.items():
        assert same_bits(state[k], v.contiguous()) and state[k].shape == v.shape, k


def test_is_stateless_matches_te_classifier():
    payloads = [pickle.dumps({}), pickle.dumps(None), pickle.dumps({"extra_fp8_variables": {}}),
                payload_bytes(te_get_extra_state(_fp8_meta(R.DelayedScaling(), history=4))),
                pickle.dumps(te1x_state(_fp8_meta(None, history=4))),
                pickle.dumps(Evil())]
    if hasattr(R, "Float8CurrentScaling"):
        payloads.append(pickle.dumps({"recipe": R.Float8CurrentScaling(), "extra_fp8_variables": {}}))
    ours = [is_stateless_extra_state(as_tensor(p)) for p in payloads]
    assert ours[:3] == [True, True, True] and ours[3:6] == [False, False, False]
    if TE_EXTRA_STATE is not None:
        theirs = [TE_EXTRA_STATE._classify_extra_state_pickle(p).name == "IGNORE" for p in payloads]
        assert ours == theirs


# --------------------------------------------------------------------------- refusals


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/te_serial_pwned",))


class EvilEval:
    def __reduce__(self):
        return (builtins.eval, ("__import__('os').system('echo pwned')",))


class EvilSubprocess:
    def __reduce__(self):
        return (subprocess.check_output, (["touch", "/tmp/te_serial_pwned"],))


class EvilLoadFromBytes:
    def __init__(self, blob):
        self.blob = blob

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.blob,))


def _typed(t: torch.Tensor):
    """The TypedStorage a tensor pickles (what ``Tensor._reduce_ex_internal`` builds)."""
    return torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)


class EvilTensor:
    def __init__(self, args):
        self.args = args

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


def _legacy_storage(dtype_name: str, declared: int, header: int, data: bytes) -> bytes:
    """A hand-built legacy ``torch.save`` of one storage (what ``_load_from_bytes`` receives)."""
    token = object()

    class P(pickle.Pickler):
        def persistent_id(self, obj):
            if obj is token:
                return ("storage", getattr(torch, dtype_name), "k", "cpu", declared, None)
            return None

    f = io.BytesIO()
    for v in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True,
                                            "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(v, f, protocol=2)
    P(f, protocol=2).dump(token)
    pickle.dump(["k"], f, protocol=2)
    f.write(struct.pack("<q", header) + data)
    return f.getvalue()


def _te_state_with(extra) -> bytes:
    meta = _fp8_meta(R.DelayedScaling(), history=4)
    state = pickle.loads(payload_bytes(te_get_extra_state(meta)))
    state["extra_fp8_variables"]["evil"] = extra
    return pickle.dumps(state)


@pytest.mark.parametrize("make, needles", [
    (lambda: pickle.dumps(Evil()), ["GLOBAL", f"{os.system.__module__}.system"]),
    (lambda: pickle.dumps(EvilEval()), ["builtins.eval"]),
    (lambda: pickle.dumps(EvilSubprocess()), ["subprocess.check_output"]),
    (lambda: b"cevil_module\nfunc\n(tR.", ["evil_module.func"]),
    (lambda: pickle.dumps(Evil(), protocol=0), [f"{os.system.__module__}.system"]),
    (lambda: _te_state_with(Evil()), [f"{os.system.__module__}.system"]),
    (lambda: _te_state_with(OrderedDict(a=1)), ["SETITEM on a collections.OrderedDict"]),
    (lambda: b"\x80\x02cbuiltins\nexec\nX\x04\x00\x00\x00passq\x00\x85R.", ["builtins.exec"]),
    (lambda: b"\x80\x04\x8c\x20transformer_engine.common.recipe\x8c\x02os\x93.",
     [f"{RECIPE_MODULE}.os"]),
    (lambda: b"\x80\x04\x8c\x05torch\x8c\x0cFloatStorage\x93.", ["torch.FloatStorage"]),
    (lambda: b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nK\x01\x85R.", ["1 arguments"]),
    (lambda: pickle.dumps(EvilTensor(("not a storage", 0, (3,), (1,), False, OrderedDict()))),
     ["_rebuild_tensor_v2 of a str"]),
    (lambda: pickle.dumps(EvilTensor((_typed(torch.ones(3)), 0, (100,), (1,), False, OrderedDict()))),
     ["reaching past its storage"]),
    (lambda: pickle.dumps(EvilTensor((_typed(torch.ones(3)), 0, (3,), (1,), False,
                                      OrderedDict(h=1)))),
     ["SETITEM on a collections.OrderedDict"]),
    (lambda: pickle.dumps(EvilLoadFromBytes(_legacy_storage("FloatStorage", 10, 10, b"\0" * 12))),
     ["claims 40 bytes but only 12 remain"]),
    (lambda: pickle.dumps(EvilLoadFromBytes(_legacy_storage("FloatStorage", 3, 1 << 40, b"\0" * 12))),
     ["holds 1099511627776 elements"]),
    (lambda: pickle.dumps(EvilLoadFromBytes(_legacy_storage("FloatStorage", 1 << 40, 1 << 40, b""))),
     ["storage of 1099511627776"]),
    (lambda: pickle.dumps(EvilLoadFromBytes(_legacy_storage("DoubleStorage", 1, 1, b"\0" * 8))),
     ["torch.DoubleStorage"]),
    (lambda: pickle.dumps(EvilLoadFromBytes(
        LEGACY_PREFIX + pickle.dumps(1001, 2) + pickle.dumps({"protocol_version": 1001}, 2)
        + pickle.dumps(Evil(), 2))), [f"{os.system.__module__}.system"]),
    (lambda: pickle.dumps(EvilLoadFromBytes(b"\x80\x02]q\x00.")), ["not a legacy torch.save"]),
    (lambda: b"\x80\x04}\x8c\x01x" + b"]" * 5000 + b"a" * 4999 + b"s.", ["nested deeper than"]),
    (lambda: b"\x80\x04" + b"(" * 1000, ["nested MARKs"]),
    (lambda: _laughs(), ["nodes"]),
    (lambda: _cycle(), ["contains itself"]),
    (lambda: b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"abc.", ["malformed pickle"]),
    (lambda: b"\x80\x04B" + struct.pack("<I", 0x7FFFFFFF) + b"abc.", ["malformed pickle"]),
    (lambda: b"\x80\x04\x8e" + struct.pack("<Q", 1 << 63) + b".", ["malformed pickle"]),
    (lambda: b"\x80\x02\x8b" + struct.pack("<i", 1 << 30) + b"\x01.", ["malformed pickle"]),
    (lambda: b"\x80\x02\x8a\xff" + b"\x01" * 255 + b".", ["wider than"]),
    (lambda: b"S'py2 string'\np0\n.", ["opcode STRING"]),
    (lambda: b"(ios\nsystem\nS'echo'\no.", ["opcode INST"]),
    (lambda: b"\x80\x02\x82\x01.", ["opcode EXT1"]),
    (lambda: b"Pfoo\n.", ["opcode PERSID"]),
    (lambda: b"\x80\x04\x8f\x94(K\x01\x90.", ["opcode EMPTY_SET"]),
    (lambda: b"\x80\x04}K\x01Q.", ["BINPERSID"]),
    (lambda: b"\x80\x04h\x05.", ["unset memo entry 5"]),
    (lambda: pickle.dumps({}) + b"junk", ["trailing bytes"]),
    (lambda: pickle.dumps([1, 2]), ["is a list, expected a dict"]),
    (lambda: pickle.dumps({"scale_fwd": "not a tensor"}), ["'scale_fwd' is a str"]),
    (lambda: b"\x80\x04", ["malformed pickle"]),
])
def test_refuses_malicious(monkeypatch, make, needles):
    data = make()  # built before the traps go in: pickle.dumps needs the real callables
    refused(monkeypatch, as_tensor(data), *needles)
    assert not os.path.exists("/tmp/te_serial_pwned")


def _laughs() -> bytes:
    x = [1] * 1000
    for _ in range(12):
        x = [x, x, x]  # pickled small thanks to the memo; 5e8 values once expanded
    return pickle.dumps({"extra_fp8_variables": {"x": x}})


def _cycle() -> bytes:
    x = []
    x.append(x)
    return pickle.dumps({"extra_fp8_variables": {"x": x}})


def test_refuses_bad_inputs(monkeypatch):
    refused(monkeypatch, torch.zeros(4, dtype=torch.float32), "expected torch.uint8")
    refused(monkeypatch, io.BytesIO(b"not a torch.save payload"), "neither a zip")
    good = io.BytesIO()
    torch.save({"scale_fwd": torch.ones(2)}, good)
    blob = bytearray(good.getvalue())
    bad = io.BytesIO()  # a storage entry shorter than its persistent id says
    with zipfile.ZipFile(io.BytesIO(bytes(blob))) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, data[:4] if "/data/" in info.filename else data)
    refused(monkeypatch, io.BytesIO(bad.getvalue()), "expected 8")
    with pytest.raises(UnsafeExtraStateError, match="unsupported extra state type"):
        decode_te_extra_state(["not", "bytes"])
    with pytest.raises(UnsafeExtraStateError):
        is_stateless_extra_state(io.BytesIO(b"PK\x03\x04garbage"))


def test_decode_never_imports_te(monkeypatch):
    """Decoding needs neither TE nor any import: recipes stay plain data."""
    data = te_get_extra_state(_fp8_meta(R.DelayedScaling(), history=4))
    monkeypatch.delitem(sys.modules, RECIPE_MODULE)
    state = decode_guarded(monkeypatch, data)  # importlib.import_module trapped as well
    assert state["recipe"]["__class__"] == "DelayedScaling"
    assert RECIPE_MODULE not in sys.modules
