"""NVIDIA ModelOpt's Hugging Face layout (what ``modelopt.torch.export.export_hf_checkpoint``
writes and vLLM / SGLang / TensorRT-LLM read with ``quant_method: "modelopt"``).

Per quantized linear ``<m>`` (``hf_quant_config.json`` ``quant_algo``):

* ``NVFP4`` / ``W4A16_NVFP4``: ``<m>.weight`` U8 ``[N, K/2]`` (E2M1, element 2i in the low
  nibble), ``<m>.weight_scale`` F8_E4M3 ``[N, K/16]`` (unpadded, unswizzled),
  ``<m>.weight_scale_2`` F32 scalar = amax / (6 · 448) (6 · 256 for 4over6 weights, which ModelOpt
  writes with the same ``quant_algo``); with NVFP4 activations
  ``<m>.input_scale`` F32 scalar = activation amax / (6 · 448). A reader's value is
  ``e2m1 · (float(weight_scale) · weight_scale_2)``.
* ``MXFP8``: ``<m>.weight`` F8_E4M3 ``[N, K]``, ``<m>.weight_scale`` U8 ``[N, K/32]`` (E8M0
  exponents); activations are MXFP8-quantized at run time.
* ``mxfp4`` (written lowercase, as ModelOpt does; dynamic MXFP4 activations) / ``W4A8_MXFP4_FP8``
  (static per-tensor FP8 activations): ``<m>.weight`` U8 ``[N, K/2]`` (E2M1, element 2i in the low
  nibble), ``<m>.weight_scale`` U8 ``[N, K/32]`` (E8M0 exponents); W4A8 adds ``<m>.input_scale`` F32
  scalar = activation amax / 448. TensorRT-LLM reads these; vLLM's and SGLang's ModelOpt paths have
  no MXFP4 (vLLM 0.33's ``QUANT_ALGOS``), so no engine te-serial tests against serves them.
* ``FP8``: ``<m>.weight`` F8_E4M3, ``<m>.weight_scale`` F32 scalar (value = fp8 · scale),
  ``<m>.input_scale`` F32 scalar = activation amax / 448 (static, required).
* ``FP8_PB_WO`` (written ``fp8_pb_wo``, lowercase, as ModelOpt 0.47 does; read in either case):
  ``<m>.weight`` F8_E4M3, ``<m>.weight_scale`` F32 ``[⌈N/128⌉, 1, ⌈K/128⌉, 1]`` (vLLM registers
  that 4-D shape; a 2-D ``[⌈N/128⌉, ⌈K/128⌉]`` is read too), weight only.

``hf_quant_config.json`` = ``{"producer": …, "quantization": {"quant_algo", "kv_cache_quant_algo",
"group_size", "exclude_modules"}}``. ``config.json``'s ``quantization_config`` is ModelOpt's flat
form (``convert_hf_quant_config_format``): ``config_groups`` (compressed-tensors style, for FP8,
NVFP4, W4A16_NVFP4 and mixed exports), ``ignore`` (the excluded modules: SGLang reads only this
key there), ``quant_algo``, ``producer`` and ``quant_method: "modelopt"``.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import torch

from ... import numerics as nx
from ..._version import __version__
from ...errors import ConversionError, UnknownLayoutError
from .base import E4M3, F32, ROW, codes_check, module_of, prefix, split
from .common import ExternalLayout, Offer

if TYPE_CHECKING:  # pragma: no cover
    from ..sources import SafetensorsSource

HF_QUANT_CONFIG = "hf_quant_config.json"
_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "MXFP8": "mxfp8", "FP8": "fp8_tensor", "FP8_PB_WO": "fp8_block",
          "MXFP4": "mxfp4", "W4A8_MXFP4_FP8": "mxfp4"}
_BLOCK = 128
#: quant_algo → the group_size ModelOpt writes beside it (plain ``mxfp4`` has none)
_GROUP = {"NVFP4": 16, "W4A16_NVFP4": 16, "MXFP8": 32, "W4A8_MXFP4_FP8": 32}
_E4M3_MAX = 448.0


def e2m1_values() -> torch.Tensor:
    """E2M1 code → value (sign in bit 3), as ModelOpt and compressed-tensors decode it."""
    mags = torch.tensor(nx.FP4_E2M1_VALUES, dtype=F32)
    return torch.cat([mags, -mags])


def e4m3_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    return scale_bytes.contiguous().view(E4M3).to(F32)


def require_nvfp4_global_scale(name: str, t, layout: str) -> None:
    """Refuse an NVFP4 weight whose global scale ``layout`` cannot state: the serving layouts hold
    one per weight, amax / divisor (6 · 448; 6 · 256 for 4over6, as ModelOpt writes it); a per-row
    amax (row-scaled NVFP4) has no such value."""
    q = t.quantizer
    lay = q.usage_layout(ROW)
    amax = t.buffers().get(lay.amax) if lay.amax is not None else None
    if lay.amax_rows or amax is None or amax.numel() != 1:
        raise ConversionError(
            f"{layout} states one global scale per weight, amax / (6 · E4M3 bound); te-serial's {q.layout_name()} "
            f"weight ({'one amax per row' if lay.amax_rows else 'no tensor amax'}) has no such value: requantize "
            "it to nvfp4 first", tensor=name)


class ModelOpt(ExternalLayout):
    family = "modelopt"
    row_local = frozenset({"mxfp8", "mxfp4", "fp8_block"})
    offers = {
        "nvfp4": Offer("modelopt_nvfp4", "ModelOpt NVFP4 (hf_quant_config.json): U8 weight, E4M3 weight_scale per 16, "
                       "weight_scale_2 = amax/(6*448)", {"weight_only": "W4A16_NVFP4", "static": "NVFP4"}),
        "mxfp8": Offer("modelopt_mxfp8", "ModelOpt MXFP8: E4M3 weight, E8M0 (U8) weight_scale per 32",
                       {"dynamic": "MXFP8"}),
        "fp8_tensor": Offer("modelopt_fp8", "ModelOpt FP8: E4M3 weight, one fp32 weight_scale, static input_scale "
                            "(needs activation amax)", {"static": "FP8"}),
        "fp8_block": Offer("modelopt_fp8_pb_wo", "ModelOpt FP8_PB_WO (quant_algo fp8_pb_wo): E4M3 weight, fp32 "
                           "weight_scale [N/128,1,K/128,1], weight-only", {"weight_only": "fp8_pb_wo"},
                           aliases=("modelopt_fp8_block",)),
        "mxfp4": Offer("modelopt_mxfp4", "ModelOpt MXFP4 (quant_algo mxfp4, or W4A8_MXFP4_FP8 with static FP8 inputs): "
                       "U8 packed E2M1 weight, E8M0 (U8) weight_scale per 32; TensorRT-LLM reads it, vLLM and SGLang "
                       "have no ModelOpt MXFP4 path", {"dynamic": "mxfp4", "static": "W4A8_MXFP4_FP8"}),
    }
    extra_file_names = (HF_QUANT_CONFIG,)
    mixed_name = "modelopt_mixed"
    source_name = "modelopt"
    weight_tensor_scales = {"nvfp4": ("weight_scale_2",), "fp8_tensor": ("weight_scale",)}
    input_scales = {"nvfp4": ("input_scale",), "fp8_tensor": ("input_scale",), "mxfp8": ("input_scale",),
                    "fp8_block": ("input_scale",), "mxfp4": ("input_scale",)}

    # --- export -----------------------------------------------------------------------------------
    def weight_keys(self, name, shape, scheme):
        n, k = shape
        p = prefix(name)
        if scheme == "nvfp4":
            return [(name, (n, k // 2), torch.uint8), (p + "weight_scale", (n, k // 16), E4M3),
                    (p + "weight_scale_2", (), F32)]
        if scheme == "mxfp8":
            return [(name, (n, k), E4M3), (p + "weight_scale", (n, k // 32), torch.uint8)]
        if scheme == "mxfp4":
            return [(name, (n, k // 2), torch.uint8), (p + "weight_scale", (n, k // 32), torch.uint8)]
        if scheme == "fp8_tensor":
            return [(name, (n, k), E4M3), (p + "weight_scale", (), F32)]
        return [(name, (n, k), E4M3), (p + "weight_scale", _block_scale_shape(n, k), F32)]

    def act_keys(self, name, scheme):
        return [(prefix(name) + "input_scale", (), F32)]

    def export(self, name, t, scheme):
        if scheme == "nvfp4":
            require_nvfp4_global_scale(name, t, self.layout_name(scheme))
        parts = split(t, scheme)
        p = prefix(name)
        scale = parts.scale.reshape(_block_scale_shape(*t.logical_shape)) if scheme == "fp8_block" else parts.scale
        out = {name: parts.data, p + "weight_scale": scale}
        if scheme == "nvfp4":
            out[p + "weight_scale_2"] = (parts.amax.to(F32) / torch.tensor(parts.divisor, dtype=F32)).reshape(())
        return out

    def export_act(self, name, scheme, amax):
        return {prefix(name) + "input_scale": self.act_scale(scheme, amax).reshape(())}

    def act_scale(self, scheme, amax):
        return torch.tensor(amax / _act_divisor(scheme), dtype=F32)

    def act_amax(self, scheme, scale):
        return scale * _act_divisor(scheme)  # exact in double: a 24-bit significand times 448 or 2688

    def reader(self, scheme, blobs, name):
        if scheme != "nvfp4":
            return None
        ws2 = blobs[prefix(name) + "weight_scale_2"].to(F32).reshape(())
        table = e2m1_values()
        return lambda codes, scales: table[codes.long()] * (e4m3_values(scales) * ws2)

    def _algo(self, scheme, mode):
        q = {"quant_algo": self.modes[scheme][mode]}
        if q["quant_algo"] in _GROUP:
            q["group_size"] = _GROUP[q["quant_algo"]]
        return q

    def _body(self, groups, ignored, kv_cache=False):
        """One scheme: its ``quant_algo``; several: ``MIXED_PRECISION`` with each layer's own
        (``quantized_layers``, as ModelOpt's per-layer export writes it)."""
        if len(groups) == 1:
            scheme, mode, _ = groups[0]
            body = self._algo(scheme, mode)
        else:
            body = {"quant_algo": "MIXED_PRECISION",
                    "quantized_layers": {m: self._algo(s, mode) for s, mode, mods in groups for m in mods}}
        return {**body, "kv_cache_quant_algo": "FP8" if kv_cache else None, "exclude_modules": list(ignored)}

    def quantization_config(self, scheme, mode, ignored, *, kv_cache=False):
        return self.mixed_config([(scheme, mode, [])], ignored, kv_cache=kv_cache)

    def mixed_config(self, groups, ignored, *, kv_cache=False):
        """``config.json``'s flat form of :meth:`_body`, as ModelOpt converts it: compressed-tensors
        style ``config_groups`` where ModelOpt writes them, ``ignore`` for the excluded modules."""
        body = self._body(groups, ignored, kv_cache)
        out: dict = {}
        if body["quant_algo"] == "MIXED_PRECISION":
            by_algo: dict[tuple, list[str]] = {}
            for layer, spec in body["quantized_layers"].items():
                by_algo.setdefault(tuple(sorted(spec.items())), []).append(layer)
            out["config_groups"] = {
                f"group_{i}": {**_group_args(dict(key)["quant_algo"], dict(key).get("group_size"), True),
                               "targets": sorted(layers)} for i, (key, layers) in enumerate(by_algo.items())}
            out["quantized_layers"] = body["quantized_layers"]
        else:
            args = _group_args(body["quant_algo"], body.get("group_size"), False)
            if args is not None:
                out["config_groups"] = {"group_0": {**args, "targets": ["Linear"]}}
        if kv_cache:  # as ModelOpt's flat form states an FP8 KV cache
            out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
        return {**out, "ignore": body["exclude_modules"], "quant_algo": body["quant_algo"],
                "producer": {"name": "te-serial", "version": __version__}, "quant_method": "modelopt"}

    def extra_files(self, groups, ignored, *, kv_cache=False):
        return {HF_QUANT_CONFIG: {"producer": {"name": "te-serial", "version": __version__},
                                  "quantization": self._body(groups, ignored, kv_cache)}}

    # --- import -------------------------------------------------------------------------------------
    def claim(self, src: "SafetensorsSource") -> None:
        algo = src.modelopt_algo  # None: no config file said (the tensors' names and dtypes do); upper case
        if algo is not None and algo not in _ALGOS and algo != "MIXED_PRECISION":
            raise UnknownLayoutError(f"ModelOpt quant_algo {algo!r} is not read (te-serial reads "
                                     f"{', '.join(_ALGOS)} and MIXED_PRECISION of them)", file=src.config_file,
                                     field="quant_algo")
        for layer, spec in (src.modelopt_layers or {}).items():
            a = spec.get("quant_algo") if isinstance(spec, dict) else None
            if not isinstance(a, str) or a.upper() not in _ALGOS:
                raise UnknownLayoutError(f"ModelOpt quant_algo {a!r} of layer {layer!r} is not read (te-serial reads "
                                         f"{', '.join(_ALGOS)})", file=src.config_file,
                                         field=f"quantized_layers.{layer}.quant_algo")
        keyset = set(src.keys())
        for k in src.keys():
            if not k.endswith(".weight_scale"):
                continue
            w = k[: -len("_scale")]
            if w not in keyset:
                src.fail(f"scale tensor has no weight next to it (expected {w!r}, ModelOpt naming)", k)
            p = prefix(w)
            wd, ws, wb = src.info(w)
            sd, ss, sb = src.info(k)
            keys = {"weight": w, "scale": k, "scheme": None}
            nbytes = wb + sb
            if wd == torch.uint8 and sd == E4M3:
                g = p + "weight_scale_2"
                if g not in keyset:
                    src.fail("NVFP4 weight without weight_scale_2 (its global scale)", w)
                n, kh = ws
                if len(ws) != 2 or ss != (n, kh * 2 // 16) or math.prod(src.info(g)[1]) != 1:
                    src.fail(f"NVFP4 weight {list(ws)} with weight_scale {list(ss)}: expected [N, K/2] and "
                              "[N, K/16] and a scalar weight_scale_2", k)
                keys.update(scheme="nvfp4", glob=g)
                nbytes += src.info(g)[2]
                shape = (n, kh * 2)
            elif wd == torch.uint8 and sd == torch.uint8:
                if len(ws) != 2 or ss != (ws[0], ws[1] * 2 // 32) or (ws[1] * 2) % 32:
                    src.fail(f"MXFP4 weight {list(ws)} with weight_scale {list(ss)}: expected U8 [N, K/2] and U8 "
                              "[N, K/32] (K a multiple of 32)", k)
                keys["scheme"], shape = "mxfp4", (ws[0], ws[1] * 2)
            elif wd == E4M3 and sd == torch.uint8:
                n, kk = ws
                if ss != (n, kk // 32):
                    src.fail(f"MXFP8 weight_scale {list(ss)} for weight {list(ws)}: expected [N, K/32]", k)
                keys["scheme"], shape = "mxfp8", tuple(ws)
            elif wd == E4M3 and sd == F32 and math.prod(ss) == 1:
                keys["scheme"], shape = "fp8_tensor", tuple(ws)
            elif wd == E4M3 and sd == F32 and len(ws) == 2 and ss in (_block_scale_shape(*ws), _block_grid(*ws)):
                keys["scheme"], shape = "fp8_block", tuple(ws)
            else:
                src.fail(f"ModelOpt weight {w!r} is {wd}{list(ws)} with weight_scale {sd}{list(ss)}: not NVFP4, "
                          "MXFP4, MXFP8, FP8 or FP8_PB_WO ([N/128, 1, K/128, 1] or [N/128, K/128]) as ModelOpt writes them", k)
            src.add_quantized(w, shape, keys, nbytes, self)
            inp = p + "input_scale"
            if inp in keyset:
                src.add_activation(module_of(w), inp, self, keys["scheme"])

    def load(self, src, st):
        keys, scheme = st.keys, st.keys["scheme"]
        data, scale = src.read(keys["weight"]), src.read(keys["scale"])
        amax = None
        if scheme == "nvfp4":
            ws2 = src.read(keys["glob"]).to(F32).reshape(())
            div = torch.tensor(st.quantizer.global_scale_divisor(), dtype=F32)
            fwd = lambda a: a / div  # noqa: E731 - ModelOpt: weight_scale_2 = amax / (6 · 448)
            amax = self.global_amax(src, st, ws2, fwd, ws2 * div, "weight_scale_2")
        if scheme == "fp8_block":  # 4-D [N/128, 1, K/128, 1] as ModelOpt writes it, or 2-D
            scale = scale.reshape(_block_grid(*st.shape))
        t = self.finish_load(src, st, data, scale, amax)
        if scheme == "nvfp4":
            src.import_checks[st.name] = codes_check(t, self.reader(scheme, {prefix(st.name) + "weight_scale_2":
                                                                             src.read(keys["glob"])}, st.name))
        return t


def _act_divisor(scheme: str) -> float:
    """input_scale = activation amax / this: the largest value of the format activations take."""
    return _E4M3_MAX * nx.FP4_MAX if scheme == "nvfp4" else _E4M3_MAX


def _block_grid(n: int, k: int) -> tuple[int, int]:
    return nx.ceil_div(n, _BLOCK), nx.ceil_div(k, _BLOCK)


def _block_scale_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """FP8_PB_WO's weight_scale shape: ModelOpt keeps each 128×128 block's amax with the block
    dims as ones, ``[⌈N/128⌉, 1, ⌈K/128⌉, 1]``."""
    rows, cols = _block_grid(n, k)
    return rows, 1, cols, 1


def _group_args(algo: str, group_size: int | None, mixed: bool) -> dict | None:
    """The compressed-tensors style arguments of one ``quant_algo`` in ModelOpt's flat config
    (``convert_hf_quant_config_format``); None where it writes no config group (a whole MXFP8 or
    FP8_PB_WO export)."""
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size or 16}
    if algo == "FP8":
        return {"input_activations": dict(fp8), "weights": dict(fp8)}
    if algo == "NVFP4":
        return {"input_activations": dict(fp4), "weights": dict(fp4)}
    if algo == "W4A16_NVFP4":
        return {"weights": fp4}
    if not mixed:
        return None
    if algo == "MXFP8":
        mx = {**fp8, "group_size": group_size or 32}
        return {"input_activations": dict(mx), "weights": dict(mx)}
    return {"quant_algo": algo}  # a layer config ModelOpt has no group arguments for


def read_hf_quant_config(path) -> dict | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None
