"""CPU test shim that lets Transformer Engine's *real* Python tensor classes load without CUDA.

Why: TE's quantized-tensor classes (``Float8Tensor``, ``MXFP8Tensor``,
``Float8BlockwiseQTensor``, ``NVFP4Tensor`` and their ``*TensorStorage`` mixins)
are plain Python, but every module that defines them does
``import transformer_engine_torch as tex`` -- TE's compiled pybind/CUDA
extension -- and ``transformer_engine.pytorch.__init__`` loads that ``.so`` via
``transformer_engine.common.load_framework_extension``.  With only the
pure-Python wheel (``pip install transformer-engine --no-deps``) nothing imports.

What :func:`install` does, confined to the current process and idempotent
(:func:`uninstall` undoes it):

* puts a fake ``transformer_engine_torch`` into ``sys.modules``: ``DType`` (an
  IntEnum with the C++ values of the members pybind exposes), ``FP8FwdTensors`` /
  ``FP8BwdTensors`` (read by ``constants.py`` at import time), and a module
  ``__getattr__`` that hands out stubs for every other name (``quantize``,
  ``dequantize``, ``fp8_transpose``, ``multi_tensor_*``...) which raise
  :class:`TEExtensionUnavailable` when called;
* imports ``transformer_engine`` with ``NVTE_PROJECT_BUILDING=1`` set just for
  that import, which skips ``transformer_engine.common``'s PyPI sanity check and its
  cuDNN/NVRTC/core-library ``ctypes`` loads;
* pre-registers bare package objects (correct ``__path__``, no ``__init__`` run) for
  ``transformer_engine.pytorch``, ``.pytorch.tensor``, ``.pytorch.tensor.storage`` and
  ``.pytorch.optimizers``, so TE's leaf modules import without the package
  ``__init__`` side effects (framework-extension load, ``torch.nn.Module.float``
  monkey-patching, ``add_safe_globals``, building every module/op);
* patches two CUDA queries *inside TE*: ``utils.is_non_tn_fp8_gemm_supported``
  (calls ``torch.cuda.get_device_capability``; replaced in every TE module that bound
  it, value settable with :func:`set_non_tn_fp8_gemm`, default False = Hopper
  layout), and ``NVFP4Quantizer.__init__`` / ``._rebuild_derived_state`` (call
  ``torch.cuda.current_device()``), which are wrapped so that *during those calls
  only* ``torch.cuda.current_device`` returns ``"cpu"`` (the RHT matrix is then
  built on CPU).  This is the one place torch itself is touched, and it is
  restored when the call returns.

When a real ``transformer_engine_torch`` is importable (a CUDA install), nothing is
faked or patched; the modules are imported normally.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Dict, Optional

import torch

__all__ = [
    "CPP_DTYPE_VALUES",
    "TEExtensionUnavailable",
    "install",
    "uninstall",
    "set_non_tn_fp8_gemm",
    "safe_globals",
    "to_te_dtype",
    "make_te_float8",
    "make_te_mxfp8",
    "make_te_blockwise",
    "make_te_nvfp4",
    "te_buffers",
    "te_quantizer_fields",
]

_TEX = "transformer_engine_torch"
_STATE_ATTR = "_te_shim_state"  # kept on the fake module so every copy of this file shares it

# transformer_engine/common/include/transformer_engine/transformer_engine.h
CPP_DTYPE_VALUES = {
    "kByte": 0, "kInt16": 1, "kInt32": 2, "kInt64": 3, "kFloat32": 4, "kFloat16": 5,
    "kBFloat16": 6, "kFloat8E4M3": 7, "kFloat8E5M2": 8, "kFloat8E8M0": 9, "kFloat4E2M1": 10,
}  # fmt: skip
# The members pybind binds (and TE's constants.py asserts are exactly tex.DType.__members__).
_PYBIND_DTYPE_NAMES = (
    "kByte", "kInt32", "kFloat32", "kFloat16", "kBFloat16",
    "kFloat8E4M3", "kFloat8E5M2", "kFloat4E2M1",
)  # fmt: skip

BUFFER_NAMES = (
    "_data", "_transpose", "_scale_inv",
    "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
    "_amax_rowwise", "_amax_columnwise",
)  # fmt: skip

_PACKAGES = ("pytorch", "pytorch/tensor", "pytorch/tensor/storage", "pytorch/optimizers")
_MODULES = {
    "constants": "transformer_engine.pytorch.constants",
    "utils": "transformer_engine.pytorch.utils",
    "quantized_tensor": "transformer_engine.pytorch.quantized_tensor",
    "float8_tensor": "transformer_engine.pytorch.tensor.float8_tensor",
    "mxfp8_tensor": "transformer_engine.pytorch.tensor.mxfp8_tensor",
    "float8_blockwise_tensor": "transformer_engine.pytorch.tensor.float8_blockwise_tensor",
    "nvfp4_tensor": "transformer_engine.pytorch.tensor.nvfp4_tensor",
    "grouped_tensor": "transformer_engine.pytorch.tensor.grouped_tensor",
}
_REF_NVFP4 = "transformer_engine.pytorch.custom_recipes.reference_nvfp4"


class TEExtensionUnavailable(RuntimeError):
    """A function of TE's compiled extension was called under the CPU test shim."""


def _stub(name: str):
    def unavailable(*_args, **_kwargs):
        raise TEExtensionUnavailable(
            f"{_TEX}.{name}() needs Transformer Engine's compiled CUDA extension; "
            "tests/te_shim.py only stands in for it so TE's Python classes can be built on CPU"
        )

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


def _make_fake_tex() -> types.ModuleType:
    tex = types.ModuleType(_TEX, "CPU stand-in for TE's compiled extension (tests/te_shim.py)")
    tex.DType = enum.IntEnum(
        "DType", [(n, CPP_DTYPE_VALUES[n]) for n in _PYBIND_DTYPE_NAMES], module=_TEX
    )
    tex.FP8FwdTensors = enum.IntEnum(
        "FP8FwdTensors",
        "GEMM1_INPUT GEMM1_WEIGHT GEMM1_OUTPUT GEMM2_INPUT GEMM2_WEIGHT GEMM2_OUTPUT GEMM3_OUTPUT",
        start=0,
        module=_TEX,
    )
    tex.FP8BwdTensors = enum.IntEnum(
        "FP8BwdTensors",
        "GRAD_OUTPUT1 GRAD_INPUT1 GRAD_OUTPUT2 GRAD_INPUT2 GRAD_OUTPUT3 GRAD_INPUT3",
        start=0,
        module=_TEX,
    )

    def __getattr__(name: str):  # every other extension symbol: a stub that raises on call
        if name.startswith("__"):
            raise AttributeError(name)
        fn = _stub(name)
        setattr(tex, name, fn)
        return fn

    tex.__getattr__ = __getattr__
    return tex


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _cuda_current_device_is_cpu():
    """Make ``torch.cuda.current_device()`` return "cpu" for the duration of a TE call."""
    orig = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = orig


def _on_cpu(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with _cuda_current_device_is_cpu():
            return method(*args, **kwargs)

    wrapper._te_shim_wrapped = method
    return wrapper


def _state() -> Optional[dict]:
    return getattr(sys.modules.get(_TEX), _STATE_ATTR, None)


def install() -> Optional[types.SimpleNamespace]:
    """Make TE's tensor/quantizer classes importable on CPU; return them, or None without TE."""
    state = _state()
    if state is not None:
        return state["te"]
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    before = set(sys.modules)
    fake = _TEX not in sys.modules and importlib.util.find_spec(_TEX) is None
    state = {"fake": fake, "patches": [], "non_tn": False}
    try:
        if fake:
            tex = _make_fake_tex()
            setattr(tex, _STATE_ATTR, state)
            sys.modules[_TEX] = tex
            for rel in _PACKAGES:
                name = "transformer_engine." + rel.replace("/", ".")
                if name not in sys.modules:
                    pkg_spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
                    pkg_spec.submodule_search_locations = [str(root / rel)]
                    pkg = importlib.util.module_from_spec(pkg_spec)
                    sys.modules[name] = pkg
            with _env("NVTE_PROJECT_BUILDING", "1"), _env("NVTE_RELEASE_BUILD", "0"):
                importlib.import_module("transformer_engine")
        mods = {key: importlib.import_module(name) for key, name in _MODULES.items()}
        try:
            ref_nvfp4 = importlib.import_module(_REF_NVFP4)
        except Exception:  # pylint: disable=broad-except  # optional oracle
            ref_nvfp4 = None
        if fake:
            _patch_cuda_queries(state, mods)
    except BaseException:
        _drop_modules(set(sys.modules) - before)
        raise
    state["added_modules"] = set(sys.modules) - before
    state["te"] = te = _namespace(mods, ref_nvfp4, fake)
    if not fake:  # keep state somewhere shared for idempotence
        setattr(sys.modules[_TEX], _STATE_ATTR, state)
    return te


def _patch_cuda_queries(state: dict, mods: Dict[str, types.ModuleType]) -> None:
    orig = mods["utils"].is_non_tn_fp8_gemm_supported

    def is_non_tn_fp8_gemm_supported() -> bool:
        return state["non_tn"]

    for name, mod in list(sys.modules.items()):
        if name.startswith("transformer_engine") and getattr(mod, "is_non_tn_fp8_gemm_supported", None) is orig:
            state["patches"].append((mod, "is_non_tn_fp8_gemm_supported", orig))
            mod.is_non_tn_fp8_gemm_supported = is_non_tn_fp8_gemm_supported
    quantizer_cls = mods["nvfp4_tensor"].NVFP4Quantizer
    for attr in ("__init__", "_rebuild_derived_state"):
        method = quantizer_cls.__dict__[attr]
        state["patches"].append((quantizer_cls, attr, method))
        setattr(quantizer_cls, attr, _on_cpu(method))
    # TE's grouped split builds each member without a device (torch.cuda.current_device())
    grouped_cls = mods["grouped_tensor"].GroupedTensorStorage
    method = grouped_cls.__dict__["split_into_quantized_tensors"]
    state["patches"].append((grouped_cls, "split_into_quantized_tensors", method))
    grouped_cls.split_into_quantized_tensors = _on_cpu(method)


def _namespace(mods, ref_nvfp4, fake: bool) -> types.SimpleNamespace:
    f8, mx, bw, nv = (mods[k] for k in ("float8_tensor", "mxfp8_tensor", "float8_blockwise_tensor", "nvfp4_tensor"))
    qt, const = mods["quantized_tensor"], mods["constants"]
    return types.SimpleNamespace(
        is_fake_extension=fake,
        tex=sys.modules[_TEX],
        DType=const.DType,
        TE_DType=const.TE_DType,
        TE_DType_To_Torch=const.TE_DType_To_Torch,
        QuantizedTensor=qt.QuantizedTensor,
        QuantizedTensorStorage=qt.QuantizedTensorStorage,
        Quantizer=qt.Quantizer,
        Float8Tensor=f8.Float8Tensor,
        Float8TensorStorage=f8.Float8TensorStorage,
        Float8Quantizer=f8.Float8Quantizer,
        Float8CurrentScalingQuantizer=f8.Float8CurrentScalingQuantizer,
        MXFP8Tensor=mx.MXFP8Tensor,
        MXFP8TensorStorage=mx.MXFP8TensorStorage,
        MXFP8Quantizer=mx.MXFP8Quantizer,
        Float8BlockwiseQTensor=bw.Float8BlockwiseQTensor,
        Float8BlockwiseQTensorStorage=bw.Float8BlockwiseQTensorStorage,
        Float8BlockQuantizer=bw.Float8BlockQuantizer,
        NVFP4Tensor=nv.NVFP4Tensor,
        NVFP4TensorStorage=nv.NVFP4TensorStorage,
        NVFP4Quantizer=nv.NVFP4Quantizer,
        GroupedTensor=mods["grouped_tensor"].GroupedTensor,
        GroupedTensorStorage=mods["grouped_tensor"].GroupedTensorStorage,
        reference_nvfp4=ref_nvfp4,
        modules=types.SimpleNamespace(**mods),
    )


def _drop_modules(names) -> None:
    """Forget TE's modules (and the fake extension); torch modules TE pulled in stay loaded."""
    for name in names:
        if name == _TEX or name == "transformer_engine" or name.startswith("transformer_engine."):
            sys.modules.pop(name, None)


def uninstall() -> None:
    """Undo :func:`install`: restore patched attributes and forget the modules it imported."""
    state = _state()
    if state is None:
        return
    for obj, attr, orig in reversed(state["patches"]):
        setattr(obj, attr, orig)
    if not state["fake"]:
        delattr(sys.modules[_TEX], _STATE_ATTR)
    _drop_modules(state["added_modules"])


def set_non_tn_fp8_gemm(value: bool) -> bool:
    """Set what the patched ``is_non_tn_fp8_gemm_supported()`` returns (True = Blackwell);
    returns the previous value.  Only meaningful with the fake extension."""
    state = _state()
    if state is None or not state["fake"]:
        raise RuntimeError("te_shim is not installed with the fake extension")
    old, state["non_tn"] = state["non_tn"], bool(value)
    return old


def safe_globals() -> list:
    """What ``transformer_engine.pytorch.__init__`` passes to ``add_safe_globals`` (the shim
    skips that ``__init__``); use as ``with torch.serialization.safe_globals(safe_globals()):``."""
    te = _require()
    out = [te.QuantizedTensorStorage, te.Quantizer, te.DType, te.tex.DType]
    for cls in ("Float8TensorStorage", "MXFP8TensorStorage", "NVFP4TensorStorage",
                "Float8BlockwiseQTensorStorage", "Float8Quantizer", "Float8CurrentScalingQuantizer",
                "MXFP8Quantizer", "NVFP4Quantizer", "Float8BlockQuantizer"):  # fmt: skip
        out.append(getattr(te, cls))
    m = te.modules
    out += [
        m.float8_tensor._make_float8_tensor_in_reduce_ex,
        m.mxfp8_tensor._make_mxfp8_tensor_in_reduce_ex,
        m.nvfp4_tensor._make_nvfp4_tensor_in_reduce_ex,
        m.float8_blockwise_tensor._make_float8_blockwise_tensor_in_reduce_ex,
    ]
    return out


# --------------------------------------------------------------------------------------
# Builders: raw buffers -> TE's own objects, through TE's real constructors.
# --------------------------------------------------------------------------------------


def _require() -> types.SimpleNamespace:
    te = install()
    if te is None:
        raise RuntimeError("transformer_engine is not installed")
    return te


def to_te_dtype(dtype) -> Any:
    """torch.float8_e4m3fn / torch.float8_e5m2 / ... or a TE/tex DType -> TE's ``DType``."""
    te = _require()
    if isinstance(dtype, torch.dtype):
        return te.TE_DType[dtype]
    return te.DType.cast(dtype)


def _device(*buffers) -> torch.device:
    for b in buffers:
        if b is not None:
            return b.device
    raise ValueError("at least one data buffer is required")


def make_te_float8(data_u8, scale_inv_f32, fp8_dtype, shape, fake_dtype, transpose_u8=None, quantizer=None):
    """``Float8Tensor`` from ``_data`` (logical shape, or None) / ``_transpose`` / ``_scale_inv``.

    ``quantizer=None`` builds a ``Float8CurrentScalingQuantizer`` whose usages follow
    the buffers given; pass ``quantizer=False`` for none (what TE's pickles carry).
    """
    te = _require()
    dt = to_te_dtype(fp8_dtype)
    if quantizer is None:
        quantizer = te.Float8CurrentScalingQuantizer(
            dt, torch.device("cpu"), rowwise=data_u8 is not None, columnwise=transpose_u8 is not None
        )
    return te.Float8Tensor(
        shape=tuple(shape),
        dtype=fake_dtype,
        data=data_u8,
        fp8_scale_inv=scale_inv_f32,
        fp8_dtype=dt,
        data_transpose=transpose_u8,
        quantizer=quantizer or None,
        device=_device(data_u8, transpose_u8),
    )


def make_te_mxfp8(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
                  fp8_dtype, shape, fake_dtype, with_gemm_swizzled_scales=False):  # fmt: skip
    """``MXFP8Tensor`` plus a matching ``MXFP8Quantizer`` (usages from the buffers given)."""
    te = _require()
    dt = to_te_dtype(fp8_dtype)
    q = te.MXFP8Quantizer(dt, rowwise=rowwise_data is not None, columnwise=columnwise_data is not None)
    q.optimize_for_gemm = with_gemm_swizzled_scales
    return te.MXFP8Tensor(
        shape=tuple(shape),
        dtype=fake_dtype,
        rowwise_data=rowwise_data,
        rowwise_scale_inv=rowwise_scale_inv,
        columnwise_data=columnwise_data,
        columnwise_scale_inv=columnwise_scale_inv,
        fp8_dtype=dt,
        quantizer=q,
        with_gemm_swizzled_scales=with_gemm_swizzled_scales,
        device=_device(rowwise_data, columnwise_data),
    )


def make_te_blockwise(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
                      fp8_dtype, shape, fake_dtype, is_2D_scaled, **quantizer_kwargs):  # fmt: skip
    """``Float8BlockwiseQTensor`` plus a ``Float8BlockQuantizer`` (block_scaling_dim 2 or 1).
    ``quantizer_kwargs`` (e.g. ``force_pow_2_scales``, ``amax_epsilon``) go to the quantizer."""
    te = _require()
    dt = to_te_dtype(fp8_dtype)
    q = te.Float8BlockQuantizer(
        dt,
        rowwise=rowwise_data is not None,
        columnwise=columnwise_data is not None,
        block_scaling_dim=2 if is_2D_scaled else 1,
        **quantizer_kwargs,
    )
    return te.Float8BlockwiseQTensor(
        shape=tuple(shape),
        dtype=fake_dtype,
        rowwise_data=rowwise_data,
        rowwise_scale_inv=rowwise_scale_inv,
        columnwise_data=columnwise_data,
        columnwise_scale_inv=columnwise_scale_inv,
        fp8_dtype=dt,
        quantizer=q,
        is_2D_scaled=is_2D_scaled,
        device=_device(rowwise_data, columnwise_data),
    )


def make_te_nvfp4(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
                  amax_rowwise, amax_columnwise, shape, fake_dtype,
                  with_gemm_swizzled_scales=False, **quantizer_kwargs):  # fmt: skip
    """``NVFP4Tensor`` plus an ``NVFP4Quantizer``; ``quantizer_kwargs`` (``with_rht``,
    ``with_2d_quantization``, ``row_scaled_nvfp4``, ...) go to the quantizer and the
    tensor's row-scaled/4over6 flags follow it."""
    te = _require()
    q = te.NVFP4Quantizer(
        rowwise=rowwise_data is not None, columnwise=columnwise_data is not None, **quantizer_kwargs
    )
    q.optimize_for_gemm = with_gemm_swizzled_scales
    return te.NVFP4Tensor(
        shape=tuple(shape),
        dtype=fake_dtype,
        rowwise_data=rowwise_data,
        rowwise_scale_inv=rowwise_scale_inv,
        columnwise_data=columnwise_data,
        columnwise_scale_inv=columnwise_scale_inv,
        amax_rowwise=amax_rowwise,
        amax_columnwise=amax_columnwise,
        fp4_dtype=te.DType.kFloat4E2M1,
        quantizer=q,
        with_gemm_swizzled_scales=with_gemm_swizzled_scales,
        row_scaled_nvfp4=q.row_scaled_nvfp4,
        nvfp4_use_4over6=q.nvfp4_use_4over6,
        nvfp4_e4m3_max=q.nvfp4_e4m3_max,
        device=_device(rowwise_data, columnwise_data),
    )


def te_buffers(t) -> Dict[str, torch.Tensor]:
    """TE's inner buffers of a tensor/storage, by TE's attribute names, omitting None."""
    out = {}
    for name in BUFFER_NAMES:
        value = getattr(t, name, None)
        if value is not None:
            out[name] = value
    return out


_QUANTIZER_FIELDS = (
    "dtype", "rowwise_usage", "columnwise_usage", "internal", "optimize_for_gemm",
    "scale", "amax",  # delayed scaling
    "with_amax_reduction", "force_pow_2_scales", "amax_epsilon",
    "block_len", "block_scaling_dim", "with_2d_quantization",
    "with_rht", "with_post_rht_amax", "stochastic_rounding", "row_scaled_nvfp4",
    "nvfp4_use_4over6", "nvfp4_e4m3_max", "nvfp4_4over6_err_mode", "rht_matrix_random_sign_mask_t",
)  # fmt: skip


def te_quantizer_fields(q) -> Dict[str, Any]:
    """The fields a TE quantizer carries (only those its class has), plus ``cls`` (class name)."""
    out: Dict[str, Any] = {"cls": type(q).__name__}
    missing = object()
    for name in _QUANTIZER_FIELDS:
        value = getattr(q, name, missing)
        if value is not missing:
            out[name] = value
    return out
