"""DeepSeek-V3 block FP8 (``quant_method: "fp8"``): ``<m>.weight`` F8_E4M3 ``[N, K]`` plus
``<m>.weight_scale_inv`` F32 ``[⌈N/128⌉, ⌈K/128⌉]`` (value = fp8 · scale_inv; DeepSeek-V3.1's
``scale_fmt: "ue8m0"`` keeps the scales powers of two, as F32 or as F8_E8M0 bytes). Activations
are quantized dynamically per 1×128 group at run time, so there is no activation choice.
``config.json``: ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"}``, with ``ignored_layers`` / ``modules_to_not_convert`` naming
the linears left in high precision."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ... import numerics as nx
from .base import E4M3, F32, split
from .common import ExternalLayout, Offer

if TYPE_CHECKING:  # pragma: no cover
    from ..sources import SafetensorsSource


class DeepSeek(ExternalLayout):
    family = "deepseek"
    offers = {"fp8_block": Offer("deepseek_fp8", "DeepSeek-V3 block FP8: E4M3 weight + fp32 weight_scale_inv per "
                                 "128x128 block", {"dynamic": "dynamic per-token-group FP8"}, aliases=("deepseek",))}

    def weight_keys(self, name, shape, scheme):
        n, k = shape
        return [(name, (n, k), E4M3), (name + "_scale_inv", (nx.ceil_div(n, 128), nx.ceil_div(k, 128)), F32)]

    def export(self, name, t, scheme):
        parts = split(t, scheme)
        return {name: parts.data, name + "_scale_inv": parts.scale}

    def quantization_config(self, scheme, mode, ignored, *, kv_cache=False):
        qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
        if ignored:
            qc["ignored_layers"] = list(ignored)
            qc["modules_to_not_convert"] = list(ignored)
        return qc

    def claim(self, src: "SafetensorsSource") -> None:
        keyset = set(src.keys())
        for k in src.keys():
            if not k.endswith("_scale_inv"):
                continue
            w = k[: -len("_scale_inv")]
            if w not in keyset:
                src.fail(f"scale tensor has no weight next to it (expected {w!r}, DeepSeek-V3 naming)", k)
            wd, ws, wb = src.info(w)
            sd, ss, sb = src.info(k)
            if wd != E4M3 or len(ws) != 2:
                src.fail(f"DeepSeek block FP8 weights are 2-D F8_E4M3, got {wd}{list(ws)}", w)
            want = (nx.ceil_div(ws[0], 128), nx.ceil_div(ws[1], 128))
            if sd not in (F32, torch.float8_e8m0fnu) or ss != want:
                src.fail(f"weight_scale_inv should be F32{list(want)} for a weight of shape {list(ws)} "
                          f"(one scale per 128x128 block), got {sd}{list(ss)}", k)
            pow2 = src.ue8m0 or sd == torch.float8_e8m0fnu
            src.add_quantized(w, tuple(ws), {"weight": w, "scale": k, "scheme": "fp8_block", "pow2": pow2},
                              wb + sb, self)

    def quantizer_for(self, src, name, scheme):
        q = super().quantizer_for(src, name, scheme)
        if q == self.representation(scheme) and (src.ue8m0 or src.info(name + "_scale_inv")[0] == torch.float8_e8m0fnu):
            from .base import representation
            return representation(scheme, pow2=True)
        return q

    def load(self, src, st):
        scale = src.read(st.keys["scale"])
        if scale.dtype == torch.float8_e8m0fnu:
            scale = nx.e8m0_dequant_scale(scale.view(torch.uint8))
        return self.finish_load(src, st, src.read(st.keys["weight"]), scale.float())
