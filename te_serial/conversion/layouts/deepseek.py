"""The ``quant_method: "fp8"`` / ``"mxfp8"`` family: block FP8 weights with ``weight_scale_inv``
(value = fp8 · scale_inv), as DeepSeek-V3 checkpoints, transformers' FineGrainedFP8 and SGLang's
``Fp8Config`` name them.

* ``deepseek_fp8`` (DeepSeek-V3 block FP8): ``<m>.weight`` F8_E4M3 ``[N, K]`` plus
  ``<m>.weight_scale_inv`` F32 ``[⌈N/128⌉, ⌈K/128⌉]``; DeepSeek-V3.1's ``scale_fmt: "ue8m0"`` keeps
  the scales powers of two, as F32 or as F8_E8M0 bytes. ``config.json``: ``{"quant_method": "fp8",
  "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}``.
* ``sglang_mxfp8`` (SGLang's native MXFP8, ``Fp8Config(use_mxfp8)``): ``<m>.weight`` F8_E4M3
  ``[N, K]`` plus ``<m>.weight_scale_inv`` U8 ``[N, ⌈K/32⌉]`` of E8M0 exponents (SGLang registers
  that parameter as uint8 and copies the bytes). ``config.json``: ``{"quant_method": "mxfp8",
  "weight_block_size": [1, 32], "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}``.

DeepSeek-V4 (read, not written): ``config.json`` says ``"expert_dtype": "fp4"`` beside the
``fp8`` quantization_config with ``scale_fmt: "ue8m0"``, and its tensors carry the scale as
``<m>.scale`` (F8_E8M0) instead of ``<m>.weight_scale_inv``: routed experts
``layers.{L}.ffn.experts.{e}.w1|w2|w3.weight`` are I8 ``[N, K/2]`` (packed E2M1 pairs, element 2i in
the low nibble) with ``.scale`` ``[N, K/32]`` — MXFP4, whose bytes are reinterpreted as U8 (a
numeric cast would change them: 2^-7 is no integer); shared experts and attention are F8_E4M3 with
``.scale`` per 128×128 block.

Activations are quantized dynamically per block at run time, so there is no activation choice.
``ignored_layers`` / ``modules_to_not_convert`` name the linears left in high precision."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ... import numerics as nx
from ...errors import ConversionError
from .base import E4M3, F32, representation, split
from .common import ExternalLayout, Offer

U8 = torch.uint8
#: scheme → (block rows, block cols) of one weight_scale_inv entry
_BLOCK = {"fp8_block": (128, 128), "mxfp8": (1, 32), "mxfp4": (1, 32)}
E8M0 = torch.float8_e8m0fnu
#: DeepSeek-V4's name for a weight's scale (``<m>.scale`` beside ``<m>.weight``)
V4_SCALE = ".scale"

if TYPE_CHECKING:  # pragma: no cover
    from ..sources import SafetensorsSource


class DeepSeek(ExternalLayout):
    family = "deepseek"
    source_name = "block_fp8_mixed"
    row_local = frozenset({"fp8_block", "mxfp8"})
    offers = {
        "fp8_block": Offer("deepseek_fp8", "DeepSeek-V3 block FP8: E4M3 weight + fp32 weight_scale_inv per 128x128 "
                           "block", {"dynamic": "dynamic per-token-group FP8"}, aliases=("deepseek",)),
        "mxfp8": Offer("sglang_mxfp8", "SGLang MXFP8 (quant_method mxfp8): E4M3 weight + E8M0 (U8) weight_scale_inv "
                       "per 1x32, scale_fmt ue8m0", {"dynamic": "dynamic MXFP8"}),
    }

    def weight_keys(self, name, shape, scheme):
        n, k = shape
        bn, bk = _BLOCK[scheme]
        return [(name, (n, k), E4M3),
                (name + "_scale_inv", (nx.ceil_div(n, bn), nx.ceil_div(k, bk)), U8 if scheme == "mxfp8" else F32)]

    def export(self, name, t, scheme):
        parts = split(t, scheme)
        return {name: parts.data, name + "_scale_inv": parts.scale}

    def quantization_config(self, scheme, mode, ignored, *, kv_cache=False):
        if scheme == "mxfp8":
            qc = {"activation_scheme": "dynamic", "quant_method": "mxfp8", "scale_fmt": "ue8m0",
                  "weight_block_size": [1, 32]}
        else:
            qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
        if ignored:
            qc["ignored_layers"] = list(ignored)
            qc["modules_to_not_convert"] = list(ignored)
        return qc

    def mixed_config(self, groups, ignored, *, kv_cache=False):
        raise ConversionError("a quant_method 'fp8' / 'mxfp8' checkpoint holds one weight scheme (its config.json "
                              "names one weight_block_size): write " + " or ".join(
                                  self.offers[s].target for s, _, _ in groups) + " alone", field="recipe")

    read_only = {"mxfp4": "deepseek_v4_fp4"}

    def claim(self, src: "SafetensorsSource") -> None:
        keyset = set(src.keys())
        for k in src.keys():
            if k.endswith("_scale_inv"):
                w = k[: -len("_scale_inv")]
                if w not in keyset:
                    src.fail(f"scale tensor has no weight next to it (expected {w!r}, DeepSeek-V3 naming)", k)
            elif k.endswith(V4_SCALE) and k[: -len(V4_SCALE)] + ".weight" in keyset:
                w = k[: -len(V4_SCALE)] + ".weight"   # DeepSeek-V4 naming
            else:
                continue
            self._claim_one(src, w, k)

    def _claim_one(self, src: "SafetensorsSource", w: str, k: str) -> None:
        wd, ws, wb = src.info(w)
        sd, ss, sb = src.info(k)
        if wd == torch.int8 and sd == E8M0:  # DeepSeek-V4 FP4 experts: packed E2M1 pairs, E8M0 per 1x32
            shape = (ws[0], ws[1] * 2) if len(ws) == 2 else tuple(ws)
            if len(ws) != 2 or ss != _want(shape, "mxfp4") or shape[1] % 32:
                src.fail(f"DeepSeek-V4 FP4 weights are I8 [N, K/2] with an F8_E8M0 scale [N, K/32]; got {wd}{list(ws)} "
                          f"with {sd}{list(ss)}", k)
            src.add_quantized(w, shape, {"weight": w, "scale": k, "scheme": "mxfp4", "pow2": True}, wb + sb, self)
            return
        if wd != E4M3 or len(ws) != 2:
            src.fail(f"block FP8 weights (weight_scale_inv / scale naming) are 2-D F8_E4M3 (or DeepSeek-V4's I8 FP4 "
                      f"with an F8_E8M0 scale), got {wd}{list(ws)}", w)
        scheme = "mxfp8" if sd == U8 else "fp8_block"   # E8M0 bytes per 1x32 (SGLang), else fp32 per 128x128
        if ss != _want(ws, scheme) or (scheme == "fp8_block" and sd not in (F32, E8M0)):
            src.fail(f"weight_scale_inv should be F32{list(_want(ws, 'fp8_block'))} (one scale per 128x128 block) "
                      f"or U8{list(_want(ws, 'mxfp8'))} (E8M0 per 1x32, SGLang MXFP8) for a weight of shape "
                      f"{list(ws)}, got {sd}{list(ss)}", k)
        pow2 = scheme == "fp8_block" and (src.ue8m0 or sd == E8M0)
        src.add_quantized(w, tuple(ws), {"weight": w, "scale": k, "scheme": scheme, "pow2": pow2}, wb + sb, self)

    def quantizer_for(self, src, name, scheme):
        q = super().quantizer_for(src, name, scheme)
        if scheme == "fp8_block" and q == self.representation(scheme) and (
                src.ue8m0 or src.info(_scale_key(src, name))[0] == E8M0):
            return representation(scheme, pow2=True)
        return q

    def load(self, src, st):
        scale = src.read(st.keys["scale"])
        if st.keys["scheme"] == "mxfp4":  # reinterpret the bytes (I8 codes, E8M0 exponents), never cast
            return self.finish_load(src, st, src.read(st.keys["weight"]).view(U8), scale.view(U8))
        if scale.dtype == E8M0:
            scale = nx.e8m0_dequant_scale(scale.view(torch.uint8))
        return self.finish_load(src, st, src.read(st.keys["weight"]), scale if scale.dtype == U8 else scale.float())


def _scale_key(src: "SafetensorsSource", weight: str) -> str:
    """The scale tensor beside ``weight``: DeepSeek-V3's ``<m>.weight_scale_inv``, else V4's ``<m>.scale``."""
    v3 = weight + "_scale_inv"
    return v3 if src.has(v3) else weight[: -len(".weight")] + V4_SCALE


def _want(shape, scheme: str) -> tuple[int, int]:
    bn, bk = _BLOCK[scheme]
    return nx.ceil_div(shape[0], bn), nx.ceil_div(shape[1], bk)
