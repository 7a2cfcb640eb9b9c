"""compressed-tensors (llm-compressor's layout, read by vLLM, SGLang and transformers with
``quant_method: "compressed-tensors"``).

Per quantized linear ``<m>``, by the group's ``format``:

* ``float-quantized`` (FP8): ``<m>.weight`` F8_E4M3 ``[N, K]`` + ``<m>.weight_scale``
  (``[N, 1]`` strategy ``channel``, ``[1]`` strategy ``tensor``; value = fp8 · scale); static
  activations add ``<m>.input_scale`` ``[1]`` = amax / 448.
* ``nvfp4-pack-quantized``: ``<m>.weight_packed`` U8 ``[N, K/2]`` (element 2i in the low
  nibble), ``<m>.weight_scale`` F8_E4M3 ``[N, K/16]``, ``<m>.weight_global_scale`` F32 ``[1]`` =
  1 / (amax / (6 · 448)) — the reciprocal of ModelOpt's ``weight_scale_2``, computed as
  compressed-tensors' own ModelOpt converter computes it, so converting te-serial's ModelOpt
  export with that converter gives this export's bytes. W4A4 adds ``<m>.input_global_scale``
  ``[1]``. compressed-tensors' reader's value is ``e2m1 · (float(weight_scale) /
  weight_global_scale)``, vLLM's ``e2m1 · (float(weight_scale) · fp32(1 / weight_global_scale))``.
* ``mxfp8-quantized``: ``<m>.weight`` F8_E4M3 ``[N, K]``, ``<m>.weight_scale`` U8 ``[N, K/32]``.
* ``mxfp4-pack-quantized`` (``MXFP4PackedCompressor``): ``<m>.weight_packed`` U8 ``[N, K/2]`` (element
  2i in the low nibble), ``<m>.weight_scale`` U8 ``[N, K/32]`` of E8M0 exponents; no global scale.
  MoE experts are per-expert linears under the model's names (gate and up apart).
* ``float-quantized`` strategy ``block`` (llm-compressor's ``FP8_BLOCK``): ``<m>.weight`` F8_E4M3
  ``[N, K]`` + ``<m>.weight_scale`` ``[⌈N/128⌉, ⌈K/128⌉]`` (value = fp8 · its block's scale),
  activations quantized at run time per token group of 128: TE's 128×128 blockwise FP8, exactly.

``config.json`` ``quantization_config``: one config group targeting ``Linear`` with the weight
and activation arguments of the scheme, ``ignore`` naming every linear left in high precision.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ... import numerics as nx
from ...errors import UnknownLayoutError
from .base import E4M3, F32, codes_check, module_of, prefix, split
from .common import ExternalLayout, Offer
from .modelopt import e2m1_values, e4m3_values, require_nvfp4_global_scale

if TYPE_CHECKING:  # pragma: no cover
    from ..sources import SafetensorsSource

_FORMAT = {"nvfp4": "nvfp4-pack-quantized", "mxfp8": "mxfp8-quantized", "mxfp4": "mxfp4-pack-quantized", "fp8_channel": "float-quantized",
           "fp8_tensor": "float-quantized", "fp8_block": "float-quantized"}
_BLOCK = [128, 128]
_NVFP4_ACT = 448.0 * 6.0   # NVFP4 activations: global scale = this / amax
_ACT_SUFFIXES = (".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point", ".q_scale",
                 ".input_global_scale")  # KV-cache scales (KV_CACHE_SCALES) are kept


def _args(num_bits, strategy, *, group_size=None, dynamic=False, scale_dtype=None, observer="minmax",
          block_structure=None):
    a = {"num_bits": num_bits, "type": "float", "symmetric": True, "group_size": group_size, "strategy": strategy,
         "dynamic": dynamic, "actorder": None, "block_structure": block_structure, "observer": observer,
         "observer_kwargs": {}}
    if scale_dtype is not None:
        a["scale_dtype"] = scale_dtype
    return a


#: vLLM 0.33's compressed-tensors MoE methods take FP8 weights only with FP8 activations
#: (``CompressedTensorsMoEMethod.get_moe_method``: W8A16 FP8 raises "unsupported")
_NO_FP8_A16_MOE = {"weight_only": "vLLM has no MoE method for FP8 weight-only (W8A16) compressed-tensors experts "
                                  "(0.33: CompressedTensorsMoEMethod.get_moe_method raises on it)"}


class CompressedTensors(ExternalLayout):
    family = "ct"
    mixed_name = "compressed_tensors_mixed"
    source_name = "compressed_tensors"
    weight_tensor_scales = {"nvfp4": ("weight_global_scale",), "fp8_tensor": ("weight_scale",)}
    input_scales = {"nvfp4": ("input_global_scale",), "fp8_tensor": ("input_scale",), "fp8_channel": ("input_scale",)}
    _FP8_MODES = {"weight_only": "FP8 W8A16", "dynamic": "FP8_DYNAMIC (W8A8, per-token activation scales)",
                  "static": "FP8 (W8A8, static per-tensor activation scales)"}
    row_local = frozenset({"fp8_channel", "fp8_block", "mxfp8", "mxfp4"})
    offers = {
        "fp8_channel": Offer("compressed_tensors_fp8", "compressed-tensors float-quantized FP8 E4M3, one weight scale "
                             "per output channel", _FP8_MODES, fmt="ct_fp8_channel",
                             aliases=("compressed-tensors", "ct_fp8"), no_moe=_NO_FP8_A16_MOE),
        "fp8_tensor": Offer("compressed_tensors_fp8_tensor", "compressed-tensors float-quantized FP8 E4M3, one weight "
                            "scale per tensor", _FP8_MODES, name="compressed_tensors_fp8", fmt="ct_fp8_tensor",
                            aliases=("ct_fp8_tensor",), no_moe=_NO_FP8_A16_MOE),
        "fp8_block": Offer("compressed_tensors_fp8_block", "compressed-tensors float-quantized FP8 E4M3, fp32 "
                           "weight_scale per 128x128 block (llm-compressor's FP8_BLOCK), dynamic per-token-group "
                           "activations", {"dynamic": "FP8_BLOCK (W8A8, activation scales per token group of 128)"},
                           fmt="ct_fp8_block", aliases=("ct_fp8_block",)),
        "nvfp4": Offer("compressed_tensors_nvfp4", "compressed-tensors nvfp4-pack-quantized: weight_packed, E4M3 "
                       "weight_scale per 16, weight_global_scale = 6*448/amax",
                       {"weight_only": "NVFP4A16", "static": "NVFP4 (W4A4)"}, fmt="ct_nvfp4", aliases=("ct_nvfp4",)),
        "mxfp8": Offer("compressed_tensors_mxfp8", "compressed-tensors mxfp8-quantized: E4M3 weight, E8M0 (U8) "
                       "weight_scale per 32", {"weight_only": "MXFP8A16", "dynamic": "MXFP8 (W8A8)"}, fmt="ct_mxfp8",
                       aliases=("ct_mxfp8",)),
        "mxfp4": Offer("compressed_tensors_mxfp4", "compressed-tensors mxfp4-pack-quantized: weight_packed (E2M1), "
                       "E8M0 (U8) weight_scale per 32", {"weight_only": "MXFP4A16", "dynamic": "MXFP4 (W4A4)"},
                       fmt="ct_mxfp4", aliases=("ct_mxfp4",)),
    }

    # --- export -----------------------------------------------------------------------------------
    def weight_keys(self, name, shape, scheme):
        n, k = shape
        p = prefix(name)
        if scheme == "nvfp4":
            return [(p + "weight_packed", (n, k // 2), torch.uint8), (p + "weight_scale", (n, k // 16), E4M3),
                    (p + "weight_global_scale", (1,), F32)]
        if scheme == "mxfp8":
            return [(name, (n, k), E4M3), (p + "weight_scale", (n, k // 32), torch.uint8)]
        if scheme == "mxfp4":
            return [(p + "weight_packed", (n, k // 2), torch.uint8), (p + "weight_scale", (n, k // 32), torch.uint8)]
        if scheme == "fp8_block":
            return [(name, (n, k), E4M3), (p + "weight_scale", (nx.ceil_div(n, 128), nx.ceil_div(k, 128)), F32)]
        return [(name, (n, k), E4M3), (p + "weight_scale", (n, 1) if scheme == "fp8_channel" else (1,), F32)]

    def act_keys(self, name, scheme):
        key = "input_global_scale" if scheme == "nvfp4" else "input_scale"
        return [(prefix(name) + key, (1,), F32)]

    def export(self, name, t, scheme):
        if scheme == "nvfp4":
            require_nvfp4_global_scale(name, t, self.layout_name(scheme))
        parts = split(t, scheme)
        p = prefix(name)
        if scheme == "nvfp4":
            ws2 = parts.amax.to(F32) / torch.tensor(parts.divisor, dtype=F32)
            return {p + "weight_packed": parts.data, p + "weight_scale": parts.scale,
                    p + "weight_global_scale": (1 / ws2).reshape(1)}
        if scheme == "mxfp4":
            return {p + "weight_packed": parts.data, p + "weight_scale": parts.scale}
        scale = parts.scale.reshape(1) if scheme == "fp8_tensor" else parts.scale
        return {name: parts.data, p + "weight_scale": scale}

    def export_act(self, name, scheme, amax):
        key = "input_global_scale" if scheme == "nvfp4" else "input_scale"
        return {prefix(name) + key: self.act_scale(scheme, amax).reshape(1)}

    #: transformers' compressed-tensors quantizer allocates weight_scale in the model's dtype
    #: (compressed_tensors.quantization.lifecycle.initialize: the observed weight's dtype) and loads
    #: the fp32 file values into it, unless CompressedTensorsConfig(dequantize=True)
    BF16_ROUTE = ("transformers' default compressed-tensors route (weight_scale held in the model's BF16; "
                  "exact with CompressedTensorsConfig(dequantize=True), vLLM and SGLang)")

    def rounding_route(self, scheme, t):
        if scheme not in ("fp8_tensor", "fp8_channel", "fp8_block"):
            return None
        parts = split(t, scheme)
        s = parts.scale.to(F32)
        r = s.to(torch.bfloat16).to(F32)
        if torch.equal(s, r):
            return None  # power-of-two (or otherwise BF16-exact) scales survive the route
        n, k = parts.data.shape
        if scheme == "fp8_block":
            grow = lambda g: g.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]  # noqa: E731
        else:
            grow = lambda g: g.reshape(-1, 1) if g.numel() > 1 else g.reshape(1, 1)  # noqa: E731
        codes = parts.data.view(E4M3).to(F32)
        return self.BF16_ROUTE, float((codes * grow(s) - codes * grow(r)).abs().max())

    def act_scale(self, scheme, amax):
        if scheme == "nvfp4":  # input_global_scale = 6 · 448 / amax, rounded once
            return torch.tensor(_NVFP4_ACT / amax, dtype=F32)
        return torch.tensor(amax / 448.0, dtype=F32)

    def act_amax(self, scheme, scale):
        # 2688 / (2688 / s) is within a double ulp of s, far inside half an fp32 ulp; s · 448 is exact
        return _NVFP4_ACT / scale if scheme == "nvfp4" else scale * 448.0

    def reader(self, scheme, blobs, name):
        if scheme != "nvfp4":
            return None
        gs = blobs[prefix(name) + "weight_global_scale"].to(F32).reshape(())
        table = e2m1_values()
        # compressed-tensors' own dequantize divides by the global scale; vLLM multiplies by its
        # reciprocal (weight_global_scale = 1 / max(...) after loading): both bounded
        return lambda codes, scales: (table[codes.long()] * (e4m3_values(scales) / gs),
                                      table[codes.long()] * (e4m3_values(scales) * (1 / gs)))

    def quantization_config(self, scheme, mode, ignored, *, kv_cache=False):
        group = self._group(scheme, mode, ["Linear"])
        return self._config({"group_0": group}, group["format"], ignored, kv_cache)

    def mixed_config(self, groups, ignored, *, kv_cache=False):
        """One config group per weight scheme, targeting its modules by name; the top-level format
        ``mixed-precision`` says each group carries its own (compressed-tensors' own rule)."""
        return self._config({f"group_{i}": self._group(s, m, mods) for i, (s, m, mods) in enumerate(groups)},
                            "mixed-precision", ignored, kv_cache)

    @staticmethod
    def _config(groups, fmt, ignored, kv_cache=False):
        kv = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False} \
            if kv_cache else None  # static per-tensor FP8 KV cache (k_scale / v_scale)
        return {"config_groups": groups, "format": fmt, "ignore": list(ignored), "kv_cache_scheme": kv,
                "quant_method": "compressed-tensors", "quantization_status": "compressed"}

    def _group(self, scheme, mode, targets):
        fmt = _FORMAT[scheme]
        if scheme == "nvfp4":
            w = _args(4, "tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn")
            act = (_args(4, "tensor_group", group_size=16, dynamic="local", scale_dtype="torch.float8_e4m3fn",
                         observer="static_minmax") if mode == "static" else None)
        elif scheme == "mxfp4":  # compressed-tensors' MXFP4A16 / MXFP4 presets
            w = _args(4, "group", group_size=32, scale_dtype="torch.uint8")
            act = (_args(4, "group", group_size=32, dynamic=True, scale_dtype="torch.uint8", observer=None)
                   if mode == "dynamic" else None)
        elif scheme == "mxfp8":
            w = _args(8, "group", group_size=32, scale_dtype="torch.uint8")
            act = (_args(8, "group", group_size=32, dynamic=True, scale_dtype="torch.uint8", observer=None)
                   if mode == "dynamic" else None)
        elif scheme == "fp8_block":
            w = _args(8, "block", block_structure=list(_BLOCK))
            act = _args(8, "group", group_size=128, dynamic=True, observer=None) if mode == "dynamic" else None
        else:
            w = _args(8, "channel" if scheme == "fp8_channel" else "tensor")
            act = {"dynamic": _args(8, "token", dynamic=True, observer=None),
                   "static": _args(8, "tensor", observer="static_minmax")}.get(mode)
        return {"targets": list(targets), "weights": w, "input_activations": act, "output_activations": None,
                "format": fmt}

    # --- import -------------------------------------------------------------------------------------
    def claim(self, src: "SafetensorsSource") -> None:
        allowed = src.ct_schemes  # None: no config to check against
        keyset = set(src.keys())
        for k in src.keys():
            if not k.endswith(".weight_scale"):
                continue
            p = k[: -len("weight_scale")]
            w, packed = p + "weight", p + "weight_packed"
            sd, ss, sb = src.info(k)
            if packed in keyset and sd == torch.uint8:  # mxfp4-pack-quantized: E8M0 bytes, no global scale
                pd, ps, pb = src.info(packed)
                if pd != torch.uint8 or len(ps) != 2 or ss != (ps[0], ps[1] * 2 // 32) or (ps[1] * 2) % 32:
                    src.fail(f"MXFP4 weight_packed {pd}{list(ps)} with weight_scale {sd}{list(ss)}: expected U8 "
                              "[N, K/2] and U8 [N, K/32] (K a multiple of 32)", k)
                keys = {"weight": packed, "scale": k, "scheme": "mxfp4"}
                shape, nbytes = (ps[0], ps[1] * 2), pb + sb
                w = packed
                name = p + "weight"
            elif packed in keyset:
                g = p + "weight_global_scale"
                pd, ps, pb = src.info(packed)
                if g not in keyset or pd != torch.uint8 or sd != E4M3 or len(ps) != 2 \
                        or ss != (ps[0], ps[1] * 2 // 16) or math.prod(src.info(g)[1]) != 1:
                    src.fail(f"NVFP4 weight_packed {pd}{list(ps)} with weight_scale {sd}{list(ss)}: expected U8 "
                              "[N, K/2], F8_E4M3 [N, K/16] and a one-element weight_global_scale", k)
                keys = {"weight": packed, "scale": k, "glob": g, "scheme": "nvfp4"}
                shape, nbytes = (ps[0], ps[1] * 2), pb + sb + src.info(g)[2]
                w = packed
                name = p + "weight"
            elif w in keyset:
                wd, ws, wb = src.info(w)
                if wd != E4M3 or len(ws) != 2:
                    src.fail(f"compressed-tensors FP8 weights are 2-D F8_E4M3, got {wd}{list(ws)}", w)
                m, kk = ws
                if sd == torch.uint8:
                    if ss != (m, kk // 32):
                        src.fail(f"MXFP8 weight_scale {list(ss)} for weight {list(ws)}: expected [N, K/32]", k)
                    scheme = "mxfp8"
                elif sd not in (F32, torch.bfloat16, torch.float16):
                    src.fail(f"weight_scale must be a float tensor, got {sd}", k)
                elif allowed is not None and "fp8_block" in allowed \
                        and ss == (nx.ceil_div(m, 128), nx.ceil_div(kk, 128)):
                    scheme = "fp8_block"  # first: a one-block weight's [1, 1] is a block scale here
                elif math.prod(ss) == 1 and len(ss) <= 2:
                    scheme = "fp8_tensor"
                elif ss in ((m, 1), (m,)):
                    scheme = "fp8_channel"
                else:
                    src.fail(f"weight_scale {list(ss)} for a weight {list(ws)} is neither per-tensor [1], "
                              "per-channel [out, 1] nor (strategy block) per 128x128 block "
                              f"[{nx.ceil_div(m, 128)}, {nx.ceil_div(kk, 128)}]", k)
                keys = {"weight": w, "scale": k, "scheme": scheme}
                shape, nbytes, name = tuple(ws), wb + sb, w
            else:
                src.fail(f"scale tensor has no weight next to it (expected {w!r}, compressed-tensors naming)", k)
            scheme = keys["scheme"]
            if allowed is not None and scheme not in allowed:
                src.fail(f"weight_scale {list(ss)} means {scheme}, but config.json's config_groups declare "
                          f"{sorted(allowed)}", k)
            zp = p + "weight_zero_point"
            if zp in keyset:
                keys["zero_point"] = zp
            src.add_quantized(name, shape, keys, nbytes, self, consumed=[w, k, keys.get("glob"), keys.get("zero_point")],
                              uniform_rows=scheme == "fp8_channel")
            act = p + ("input_global_scale" if scheme == "nvfp4" else "input_scale")
            if act in keyset:
                src.add_activation(module_of(name), act, self, scheme)
        for k in src.keys():
            if k.endswith(_ACT_SUFFIXES) and k not in src.consumed:
                src.drop(k, "compressed-tensors activation/KV-cache parameter, not a weight")

    def load(self, src, st):
        keys, scheme = st.keys, st.keys["scheme"]
        data, scale = src.read(keys["weight"]), src.read(keys["scale"])
        zp = keys.get("zero_point")
        if zp is not None and bool((src.read(zp).float() != 0).any()):
            src.fail("nonzero weight_zero_point: asymmetric quantization is not a layout te-serial reads", zp)
        amax = None
        if scheme == "nvfp4":
            gs = src.read(keys["glob"]).to(F32).reshape(())
            div = torch.tensor(st.quantizer.global_scale_divisor(), dtype=F32)
            fwd = lambda a: 1 / (a / div)  # noqa: E731 - the reciprocal of ModelOpt's amax / (6 · 448)
            amax = self.global_amax(src, st, gs, fwd, div / gs, "weight_global_scale")
        elif scheme == "fp8_channel":
            scale = scale.reshape(-1, 1)
        t = self.finish_load(src, st, data, scale.float() if scale.dtype in (torch.bfloat16, torch.float16) else scale,
                             amax)
        if scheme == "nvfp4":
            src.import_checks[st.name] = codes_check(
                t, self.reader(scheme, {prefix(st.name) + "weight_global_scale": src.read(keys["glob"])}, st.name))
        return t


def ct_schemes(qc: dict, cfg_file: str) -> set[str]:
    """The weight schemes a compressed-tensors config declares, refusing what te-serial does not read."""
    fmt = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UnknownLayoutError("compressed-tensors config has no config_groups", file=cfg_file,
                                 field="quantization_config.config_groups")
    out: set[str] = set()
    for gname, group in groups.items():
        group = group or {}
        gfmt = group.get("format") or fmt
        where = f"quantization_config.config_groups.{gname}"
        if gfmt not in ("float-quantized", "nvfp4-pack-quantized", "mxfp8-quantized", "mxfp4-pack-quantized"):
            raise UnknownLayoutError(f"compressed-tensors format {gfmt!r} (group {gname!r}) is not read; te-serial reads "
                                     "'float-quantized' FP8, 'nvfp4-pack-quantized', 'mxfp8-quantized' and "
                                     "'mxfp4-pack-quantized'",
                                     file=cfg_file, field=where)
        w = group.get("weights")
        if not w:
            continue
        where += ".weights"
        if w.get("symmetric") is False:
            raise UnknownLayoutError("asymmetric weights (zero points) are not read", file=cfg_file, field=where)
        if w.get("dynamic") is True:
            raise UnknownLayoutError("dynamic weight quantization stores no weight scales", file=cfg_file, field=where)
        bits, strategy = w.get("num_bits"), w.get("strategy")
        if w.get("type") != "float" or bits not in (4, 8):
            raise UnknownLayoutError(f"weights are {w.get('type')!r} with {bits!r} bits; te-serial reads 8-bit float "
                                     "(FP8 E4M3, MXFP8) and 4-bit float (NVFP4, MXFP4)", file=cfg_file, field=where)
        if gfmt == "nvfp4-pack-quantized":
            if bits != 4 or w.get("group_size") != 16:
                raise UnknownLayoutError("NVFP4 weights are 4-bit floats in groups of 16", file=cfg_file, field=where)
            out.add("nvfp4")
        elif gfmt == "mxfp4-pack-quantized":
            if bits != 4 or w.get("group_size") != 32:
                raise UnknownLayoutError("MXFP4 weights are 4-bit floats in groups of 32", file=cfg_file, field=where)
            out.add("mxfp4")
        elif gfmt == "mxfp8-quantized":
            if bits != 8 or w.get("group_size") != 32:
                raise UnknownLayoutError("MXFP8 weights are 8-bit floats in groups of 32", file=cfg_file, field=where)
            out.add("mxfp8")
        else:
            if bits != 8 or strategy not in ("tensor", "channel", "block"):
                raise UnknownLayoutError(f"weight strategy {strategy!r} is not read (te-serial reads 'tensor', "
                                         "'channel' and 'block' [128, 128])", file=cfg_file, field=where)
            if strategy == "block" and list(w.get("block_structure") or []) != _BLOCK:
                raise UnknownLayoutError(f"block_structure {w.get('block_structure')!r} is not read (te-serial reads "
                                         "[128, 128], TE's blockwise FP8)", file=cfg_file, field=where + ".block_structure")
            out.add("fp8_" + strategy)
    return out

