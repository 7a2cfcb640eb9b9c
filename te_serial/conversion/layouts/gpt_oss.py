"""OpenAI gpt-oss's MXFP4 layout (``quant_method: "mxfp4"``), as the released checkpoints,
transformers' ``Mxfp4`` quantizer and vLLM's ``Mxfp4MoEMethod`` name it.

Only a MoE layer's experts are MXFP4; everything else (attention, router, embeddings, head, the
experts' biases) stays BF16 under transformers' names. Per layer, ``E`` experts, hidden ``H``,
intermediate ``I``, for ``<p>.experts.gate_up_proj`` (and ``down_proj`` alike):

* ``<p>.experts.gate_up_proj_blocks`` U8 ``[E, 2I, H/32, 16]``: each expert's ``[out, in]`` weight,
  E2M1 codes two per byte (element 2j in the low nibble), 32 elements per ``[.., 16]`` block;
* ``<p>.experts.gate_up_proj_scales`` U8 ``[E, 2I, H/32]``: one E8M0 exponent per block;
* ``<p>.experts.gate_up_proj_bias`` BF16 ``[E, 2I]``, a plain tensor.

Gate and up are interleaved by row (row 2j is gate j, 2j+1 up j) in the file and in transformers'
parameter alike, so nothing is reordered. transformers holds ``gate_up_proj`` as ``[E, H, 2I]``
(``in, out``): the transpose of each stored expert. te-serial's grouped MXFP4 tensor of a gpt-oss
expert stack quantizes each expert as its transpose (``per_expert(..., transposed=True)``: the
``[out, in]`` weight, blocks along the reduction dim), so its rowwise bytes are the file's bytes.

``config.json``: ``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``
(the only keys ``Mxfp4Config.to_dict`` writes; ``dequantize`` is a load option).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...errors import ConversionError
from ...formats import Quantizer
from ...formats.grouped import GroupedTensor, per_expert
from ...precision import is_expert_weight
from .base import assemble, split
from .common import ExternalLayout, Offer

if TYPE_CHECKING:  # pragma: no cover
    from ..sources import SafetensorsSource, SourceTensor

U8 = torch.uint8
BLOCKS, SCALES = "_blocks", "_scales"
#: elements per E8M0 scale, and bytes of codes per block (two E2M1 codes a byte)
BLOCK = 32
BLOCK_BYTES = BLOCK // 2
QUANT_METHOD = "mxfp4"


class GptOss(ExternalLayout):
    family = "gpt_oss"
    offers = {
        "mxfp4": Offer("gpt_oss_mxfp4", "gpt-oss MXFP4 (quant_method mxfp4): MoE experts as <p>.experts.<proj>_blocks "
                       "U8 [E, out, in/32, 16] and _scales U8 [E, out, in/32], everything else BF16; read by "
                       "transformers' Mxfp4 quantizer and vLLM's Mxfp4MoEMethod",
                       {"weight_only": "MXFP4 experts (activations as the engine's MXFP4 MoE kernel takes them)"},
                       aliases=("gpt_oss",)),
    }
    experts_only = True

    # --- export -------------------------------------------------------------------------------------
    def expert_representation(self, scheme: str, shape: tuple[int, ...]) -> Quantizer:
        """A gpt-oss expert stack ``[E, in, out]``: each expert quantized as its ``[out, in]`` transpose."""
        return per_expert(self.representation(scheme), shape, transposed=True)

    def weight_keys(self, name, shape, scheme):
        e, k, n = shape   # transformers' [E, in, out]
        return [(name + BLOCKS, (e, n, k // BLOCK, BLOCK_BYTES), U8), (name + SCALES, (e, n, k // BLOCK), U8)]

    def export(self, name, t, scheme):
        e, k, n = t.logical_shape
        parts = [split(m, scheme) for m in t.members()]   # each expert's [out, in] rowwise bytes
        return {name + BLOCKS: torch.stack([p.data for p in parts]).view(e, n, k // BLOCK, BLOCK_BYTES),
                name + SCALES: torch.stack([p.scale for p in parts])}

    def quantization_config(self, scheme, mode, ignored, *, kv_cache=False):
        return {"modules_to_not_convert": list(ignored), "quant_method": QUANT_METHOD}

    def mixed_config(self, groups, ignored, *, kv_cache=False):
        raise ConversionError("a gpt-oss checkpoint holds its experts in MXFP4 and nothing else quantized: write "
                              "gpt_oss_mxfp4 alone", field="recipe")

    # --- import -------------------------------------------------------------------------------------
    def claim(self, src: "SafetensorsSource") -> None:
        for k in src.keys():
            if not k.endswith(BLOCKS):
                continue
            name = k[: -len(BLOCKS)]
            s = name + SCALES
            if not src.has(s):
                src.fail(f"MXFP4 blocks without their scales (expected {s!r}, gpt-oss naming)", k)
            bd, bs, bb = src.info(k)
            sd, ss, sb = src.info(s)
            if bd != U8 or sd != U8 or len(bs) != 4 or bs[3] != BLOCK_BYTES or tuple(ss) != tuple(bs[:3]):
                src.fail(f"gpt-oss MXFP4 experts are U8 blocks [E, out, in/32, 16] with U8 scales [E, out, in/32]; "
                          f"got {bd}{list(bs)} and {sd}{list(ss)}", k)
            e, n, kb, _ = bs
            shape = (e, kb * BLOCK, n)   # transformers' [E, in, out]
            if not is_expert_weight(name, shape):
                src.fail("MXFP4 blocks outside a MoE layer's experts: gpt-oss quantizes only "
                          "<p>.experts.gate_up_proj / down_proj", k)
            src.add_quantized(name, shape, {"weight": k, "scale": s, "scheme": "mxfp4"}, bb + sb, self)

    def quantizer_for(self, src, name, scheme):
        e, n, kb, _ = src.info(name + BLOCKS)[1]
        return self.expert_representation(scheme, (e, kb * BLOCK, n))

    def load(self, src: "SafetensorsSource", st: "SourceTensor") -> torch.Tensor:
        return self.load_members(src, st, 0, st.quantizer.num_tensors)

    def load_members(self, src: "SafetensorsSource", st: "SourceTensor", start: int, stop: int) -> torch.Tensor:
        g = st.quantizer.member_span(start, stop)[0]
        member, (n, k) = g.member, g.member_shapes[0]
        blocks, scales = src.read(st.keys["weight"]), src.read(st.keys["scale"])
        members = [assemble(member, (n, k), st.dtype, blocks[i].reshape(n, k // 2), scales[i]).buffers()
                   for i in range(start, stop)]
        return GroupedTensor(g.group_shape, st.dtype, g, **g.merge_buffers(members, views=True))  # the file's pages

