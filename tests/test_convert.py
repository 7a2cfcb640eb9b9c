"""te_serial.convert: every source layout × every target on small checkpoints, the exact paths
bit-exact, the lossy ones within their format's error bound, and the report's figures checked
against values read back independently (te-serial's loader, safetensors, reference dequantizers)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.errors import ConversionError
from te_serial.recipes import RECIPES, recipe_quantizer

from _convert_data import (E4M3, _write_hf, ct_checkpoint, ct_dequantize, deepseek_checkpoint,
                           deepseek_dequantize, mxfp4_dequantize, mxfp8_dequantize, nvfp4_dequantize,
                           plain_state_dict, randn)

tc = importlib.import_module("te_serial.conversion")

PLAIN_TARGETS = ("bf16", "fp16", "fp32")
SOURCES = [f"te:{r}" for r in RECIPES] + ["plain", "plain_sharded", "deepseek", "ct_tensor", "ct_channel"]
TARGETS = list(tc.TARGETS)

_BLOCK_OUT = {"deepseek_fp8", "modelopt_fp8_pb_wo", "compressed_tensors_fp8_block"}
_PER_TENSOR_EXACT = {"fp8_current", "fp8_delayed", "fp8_block", "fp8_block_1d", "compressed_tensors_fp8",
                     "compressed_tensors_fp8_tensor", "modelopt_fp8", *_BLOCK_OUT}
_NVFP4_OUT = {"modelopt_nvfp4", "compressed_tensors_nvfp4"}
_MXFP8_OUT = {"modelopt_mxfp8", "compressed_tensors_mxfp8", "sglang_mxfp8"}
_MXFP4_OUT = {"modelopt_mxfp4", "compressed_tensors_mxfp4"}
#: source format → targets whose path is exact (written from the formats' definitions, not the code)
EXACT = {
    "fp8_current": _PER_TENSOR_EXACT, "fp8_delayed": _PER_TENSOR_EXACT, "ct_fp8_tensor": _PER_TENSOR_EXACT,
    "fp8_current_e5m2": {"fp8_current_e5m2"},
    "mxfp8": {"mxfp8", *_MXFP8_OUT}, "mxfp8_2d": {"mxfp8_2d", "mxfp8", *_MXFP8_OUT},
    "fp8_block_1d": {"fp8_block_1d"},
    "fp8_block": {"fp8_block", "fp8_block_1d", *_BLOCK_OUT},
    "deepseek_fp8": {"fp8_block", "fp8_block_1d", *_BLOCK_OUT},
    "ct_fp8_channel": {"compressed_tensors_fp8", "fp8_block_1d"},
    "nvfp4": {"nvfp4", *_NVFP4_OUT}, "nvfp4_2d": {"nvfp4_2d", "nvfp4", *_NVFP4_OUT},
    # another divisor (6 * 256): exact into itself and into the serving layouts, which state it as
    # it is (amax / 1536, as ModelOpt writes 4over6); a per-row amax only into itself
    "nvfp4_4over6": {"nvfp4_4over6", *_NVFP4_OUT}, "nvfp4_row_scaled": {"nvfp4_row_scaled"},
    # each code's E4M3 byte under the same scale byte, in either usage (shared/docs/mxfp4.md §6); NVFP4
    # keeps only the rowwise codes (its columnwise copy is requantized)
    "mxfp4": {"mxfp4", "mxfp8", *_MXFP8_OUT, *_MXFP4_OUT},
}
#: (max |err| / amax, rel RMSE) bounds of one rounding into each target format
BOUNDS = {"e4m3": (1 / 16, 0.05), "e5m2": (1 / 8, 0.1), "fp4": (0.25, 0.2), "fp16": (1e-3, 1e-3),
          "bf16": (1 / 128, 1e-2)}


def _bound_key(target: str) -> str:
    if "fp4" in target:  # NVFP4 and MXFP4: E2M1 codes
        return "fp4"
    if target.endswith("e5m2"):
        return "e5m2"
    if target in PLAIN_TARGETS:
        return target
    return "e4m3"


def _te_source_dict(recipe: str) -> dict:
    sd = plain_state_dict()
    out = {}
    for name, t in sd.items():
        if t.dim() == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name:
            q = recipe_quantizer(recipe)
            try:
                q.check_shape(tuple(t.shape))
            except tse.ShapeError:
                out[name] = t
                continue
            out[name] = q(t)
        else:
            out[name] = t
    out["model.layers.0.stack.w"] = recipe_quantizer(recipe)(randn((2, 64, 128), 9))  # 3-D, not experts: kept
    return out


def _usage_values(t) -> dict[str, torch.Tensor]:
    if isinstance(t, tsf.QuantizedTensor):
        return {u: tc.values(t, u) for u in ("rowwise", "columnwise") if getattr(t.quantizer, u)}
    return {"plain": t.float()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for recipe in RECIPES:
        path = root / f"te-{recipe}"
        ts.save_quantized(_te_source_dict(recipe), path)
        loaded = ts.load_quantized(path)
        fmts = {n: (recipe if isinstance(t, tsf.QuantizedTensor) else "plain") for n, t in loaded.items()}
        out[f"te:{recipe}"] = (path, {n: _usage_values(t) for n, t in loaded.items()}, fmts)
    sd = plain_state_dict()
    (root / "plain").mkdir()
    from safetensors.torch import save_file
    save_file(sd, str(root / "plain" / "model.safetensors"), metadata={"format": "pt"})
    ref = {n: {"plain": t.float()} for n, t in sd.items()}
    out["plain"] = (root / "plain", ref, dict.fromkeys(sd, "plain"))
    _write_hf(root / "plain_sharded", sd, {"architectures": ["LlamaForCausalLM"]}, shards=3)
    out["plain_sharded"] = (root / "plain_sharded", ref, dict.fromkeys(sd, "plain"))
    ds = deepseek_checkpoint(root / "deepseek")
    out["deepseek"] = (root / "deepseek", {n: {"plain": v} for n, v in ds.items()},
                       {n: ("deepseek_fp8" if n.endswith(("proj.weight", "mqa.weight")) else "plain") for n in ds})
    for strategy in ("tensor", "channel"):
        ct = ct_checkpoint(root / f"ct_{strategy}", strategy)
        out[f"ct_{strategy}"] = (root / f"ct_{strategy}", {n: {"plain": v} for n, v in ct.items()},
                                 {n: (f"ct_fp8_{strategy}" if n.endswith("proj.weight") else "plain") for n in ct})
    return out


def _read_output(dst: Path, family: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
    """name → usage → fp32 values, and name → bytes, read back without te_serial.convert."""
    if family == "te-serial":
        loaded = ts.load_quantized(dst)
        nbytes = {n: (t.quantized_nbytes() if isinstance(t, tsf.QuantizedTensor) else t.numel() * t.element_size())
                  for n, t in loaded.items()}
        return {n: _usage_values(t) for n, t in loaded.items()}, nbytes
    raw: dict[str, torch.Tensor] = {}
    for p in sorted(dst.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})
    index = json.loads((dst / "model.safetensors.index.json").read_text())  # written even for one shard
    assert set(index["weight_map"]) == set(raw)
    vals, nbytes = {}, {}
    size = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    for k, t in raw.items():
        if k.endswith(("_scale_inv", "weight_scale", "weight_scale_2", "weight_global_scale", "input_scale",
                       "input_global_scale")):
            continue
        p = k[: -len("weight_packed")] if k.endswith("weight_packed") else k[: -len("weight")]
        name = p + "weight"
        act = [raw[p + a] for a in ("input_scale", "input_global_scale") if p + a in raw]
        if family == "deepseek_fp8" and k + "_scale_inv" in raw:
            s = raw[k + "_scale_inv"]
            vals[k], nbytes[k] = {"plain": deepseek_dequantize(t, s)}, size(t, s)
        elif family == "sglang_mxfp8" and k + "_scale_inv" in raw:  # E8M0 bytes per 1x32, SGLang's naming
            s = raw[k + "_scale_inv"]
            vals[k], nbytes[k] = {"plain": mxfp8_dequantize(t, s)}, size(t, s)
        elif family.endswith("nvfp4") and p + "weight_scale" in raw:
            s = raw[p + "weight_scale"]
            g = raw[p + ("weight_scale_2" if family.startswith("modelopt") else "weight_global_scale")]
            vals[name] = {"plain": nvfp4_dequantize(t, s, g, family.startswith("modelopt"))}
            nbytes[name] = size(t, s, g, *act)
        elif family.endswith("mxfp4") and p + "weight_scale" in raw:   # packed E2M1, E8M0 bytes per 1x32
            s = raw[p + "weight_scale"]
            vals[name], nbytes[name] = {"plain": mxfp4_dequantize(t, s)}, size(t, s, *act)
        elif family.endswith("mxfp8") and p + "weight_scale" in raw:
            s = raw[p + "weight_scale"]
            vals[k], nbytes[k] = {"plain": mxfp8_dequantize(t, s)}, size(t, s, *act)
        elif p + "weight_scale" in raw:  # per-tensor / per-channel / 128x128 FP8 (ModelOpt, compressed-tensors)
            s = raw[p + "weight_scale"]
            if s.dim() == 4:  # ModelOpt FP8_PB_WO: [N/128, 1, K/128, 1]
                s = s.reshape(s.shape[0], s.shape[2])
            block = family in ("modelopt_fp8_pb_wo", "compressed_tensors_fp8_block")
            deq = deepseek_dequantize(t, s) if block else ct_dequantize(t, s)
            vals[k], nbytes[k] = {"plain": deq}, size(t, s, *act)
        else:
            assert t.dtype != E4M3, k
            vals[k], nbytes[k] = {"plain": t.float()}, size(t)
    return vals, nbytes


def _stats(ref: torch.Tensor, out: torch.Tensor) -> tuple[bool, float, float, float]:
    exact = torch.equal(ref.view(torch.int32), out.view(torch.int32))
    d = (out.double() - ref.double())
    e2, s2 = float((d * d).sum()), float((ref.double() ** 2).sum())
    return (exact, float(d.abs().max()) if d.numel() else 0.0, math.sqrt(e2 / s2) if s2 else 0.0,
            10 * math.log10(s2 / e2) if e2 else math.inf)


#: the serving layouts added with ModelOpt / NVFP4 / MXFP8 (every TE recipe into each of them is in
#: test_serving_layouts.py): here against a few sources of each kind, to keep the matrix's time down
_NEW_SERVING = {"compressed_tensors_nvfp4", "compressed_tensors_mxfp8", "modelopt_nvfp4", "modelopt_mxfp8",
                "modelopt_fp8", "modelopt_fp8_pb_wo", "compressed_tensors_fp8_block", *_MXFP4_OUT}
_NEW_SERVING_SOURCES = {"te:nvfp4_2d", "te:mxfp8", "te:fp8_current", "plain", "deepseek", "ct_channel"}
#: targets that quantize MoE experts only (this matrix's checkpoints have none): tests/test_mxfp4_layouts.py
_EXPERTS_ONLY = {"gpt_oss_mxfp4"}
#: the NVFP4 variants (4over6, row-scaled; test_nvfp4_variants.py holds their rules) against a few
#: partners each way, for the same reason
_VARIANTS = {"nvfp4_4over6", "nvfp4_row_scaled"}
_VARIANT_PARTNERS = {"te:nvfp4_2d", "plain", "nvfp4", "bf16", "modelopt_nvfp4", "compressed_tensors_nvfp4", *_VARIANTS}


def _in_matrix(s: str, t: str) -> bool:
    if t in _EXPERTS_ONLY:
        return False
    if t in _MXFP4_OUT and s == "te:mxfp4":   # the exact path into the MXFP4 serving layouts
        return True
    src_variant = s.removeprefix("te:") in _VARIANTS
    if src_variant or t in _VARIANTS:
        return (t if src_variant else s).removeprefix("te:") in _VARIANT_PARTNERS or s in _VARIANT_PARTNERS
    return t not in _NEW_SERVING or s in _NEW_SERVING_SOURCES


MATRIX = [(s, t) for s in SOURCES for t in TARGETS if _in_matrix(s, t)]


@pytest.mark.parametrize("source,target", MATRIX)
def test_every_source_to_every_target(sources, source, target, tmp_path):
    path, ref, fmts = sources[source]
    amax = {n: 1.0 for n in ref} if target == "modelopt_fp8" else None  # its FP8 needs static input scales
    # MoE experts in compressed-tensors FP8 are served with FP8 activations only (weight-only is refused: test_moe)
    acts = "dynamic" if source == "deepseek" and target.startswith("compressed_tensors_fp8") else "auto"
    rep = tc.convert(path, tmp_path / "out", recipe=target, max_shard_size="300KB", activation_amax=amax,
                     activations=acts)
    got, nbytes = _read_output(tmp_path / "out", rep.target_layout)
    assert [t.name for t in rep.tensors] == list(ref) or set(t.name for t in rep.tensors) == set(ref)
    assert set(got) == set(ref)
    for t in rep.tensors:
        src_fmt = fmts[t.name]
        out_vals, src_vals = got[t.name], ref[t.name]
        assert t.dst_bytes == nbytes[t.name], t.name
        # each output usage against the source's same usage, or (requantized) its primary values
        primary = next(iter(src_vals.values()))
        rebuilt = t.method in ("quantize", "requantize")
        per_usage = [_stats(primary if rebuilt else src_vals.get(u, primary), v) for u, v in out_vals.items()]
        exact = all(s[0] for s in per_usage)
        if t.label == "lossless":
            assert exact, (t.name, t.method)
        codes = t.label == "exact codes"  # NVFP4 in a serving layout: its reader's global-scale formula
        if codes:
            for u, v in out_vals.items():
                d = _ulps(src_vals.get(u, primary), v)
                assert int(d.max()) <= t.ulp_max and int((d > 0).sum()) <= t.ulp_elements, (t.name, t.ulp_max)
                assert float((src_vals.get(u, primary) - v).abs().max()) <= t.max_abs_err, t.name
        requantized = t.method in ("quantize", "requantize")
        if not requantized:  # exact paths and casts are labelled by what the values did
            assert (t.label == "lossless") == exact or (codes and not exact), (t.name, t.method, t.label)
        if t.method == "keep":
            assert exact, t.name
            continue
        if target not in PLAIN_TARGETS and src_fmt != "plain" and t.method != "dequantize":
            assert (t.label in ("lossless", "exact codes")) == (target in EXACT[src_fmt]), \
                (t.name, src_fmt, target, t.method)
            assert codes <= (target in _NVFP4_OUT), (t.name, target)  # only two-level formats
            assert requantized == (target not in EXACT[src_fmt]), (t.name, src_fmt, target, t.method)
        if t.label == "lossy":
            worst = (max(s[1] for s in per_usage), max(s[2] for s in per_usage), min(s[3] for s in per_usage))
            assert math.isclose(t.max_abs_err, worst[0], rel_tol=1e-5, abs_tol=1e-12), t.name
            assert math.isclose(t.rel_rmse, worst[1], rel_tol=1e-3), t.name
            assert math.isclose(t.snr_db, worst[2], rel_tol=1e-3, abs_tol=1e-3), t.name
            amax = max(float(v.abs().max()) for v in src_vals.values())
            c_abs, c_rel = BOUNDS[_bound_key(target)]
            assert t.max_abs_err <= c_abs * amax * (1 + 1e-6), (t.name, t.max_abs_err, amax)
            assert t.rel_rmse <= c_rel, (t.name, t.rel_rmse)
        elif not codes:
            assert (t.max_abs_err, t.rel_rmse, t.snr_db) == (0.0, 0.0, math.inf)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in fp32 ulp (ordered bit patterns)."""
    def ordered(x):
        i = x.float().contiguous().view(torch.int32).long()
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()


# --- the exact paths, bit for bit ---------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 100, 260), (128, 128)])
def test_blockwise_2d_to_1d_is_bit_exact(shape, tmp_path):
    """A 128×128 tile's scale applied to each 1×128 row segment (rowwise) and each 128-long column
    segment (columnwise) gives the same FP8 bytes: both usages dequantize to the same values."""
    x = randn(shape, 3, scale=1.0)
    x.view(-1)[7] = 300.0  # an outlier: tiles with very different scales
    for pow2 in (True, False):
        q = ts.Float8BlockQuantizer(E4M3, block_scaling_dim=2, force_pow_2_scales=pow2)
        src = q(x)
        ts.save_quantized({"w.weight": src}, tmp_path / f"src{pow2}")
        rep = tc.convert(tmp_path / f"src{pow2}", tmp_path / f"dst{pow2}", rules={"*": "fp8_block_1d"})
        assert rep["w.weight"].label == "lossless" and rep["w.weight"].method == "relayout"
        out = ts.load_quantized(tmp_path / f"dst{pow2}")["w.weight"]
        assert out.quantizer.block_scaling_dim == 1 and out.quantizer.force_pow_2_scales == pow2
        for u in ("rowwise", "columnwise"):
            a, b = tc.values(src, u), tc.values(out, u)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), u
        assert torch.equal(out.buffers()["_rowwise_data"], src.buffers()["_rowwise_data"])
        assert torch.equal(out.buffers()["_columnwise_data"], src.buffers()["_columnwise_data"])


@pytest.mark.parametrize("shape", [(256, 384), (2, 64, 128)])
@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed", "fp8_block", "mxfp8_2d", "nvfp4_2d"])
@pytest.mark.parametrize("have", ["rowwise", "columnwise"])
def test_missing_usage_derived_equals_te_quantization(recipe, have, shape, tmp_path):
    """Where TE's columnwise copy is the rowwise one transposed (per-tensor FP8, 128×128 blockwise,
    MXFP8 32×32, NVFP4 16×16), the missing usage is rebuilt byte for byte as TE would quantize it."""
    x = randn(shape, 5, scale=0.5)
    one = recipe_quantizer(recipe, rowwise=have == "rowwise", columnwise=have == "columnwise")(x)
    both = recipe_quantizer(recipe)(x)
    ts.save_quantized({"w.weight": one}, tmp_path / "src")
    rep = tc.convert(tmp_path / "src", tmp_path / "dst", rules={"*": recipe}, usages="both")
    assert rep["w.weight"].label == "lossless" and rep["w.weight"].method == "relayout"
    out = ts.load_quantized(tmp_path / "dst")["w.weight"]
    want = both.buffers()
    for name, b in out.buffers().items():
        assert torch.equal(b.view(torch.uint8), want[name].view(torch.uint8)), name


_ENGINE_TARGETS = ("deepseek_fp8", "compressed_tensors_fp8", "compressed_tensors_fp8_tensor")


@pytest.mark.parametrize("shape,target", [
    (shape, target) for shape in [(256, 384), (200, 300), (3, 100, 260)]
    for target in ["fp8_block", "fp8_block_1d", *_ENGINE_TARGETS, "fp8_delayed"]
    if len(shape) == 2 or target not in _ENGINE_TARGETS])   # engine layouts hold 2-D weights
def test_per_tensor_fp8_into_block_layouts_is_bit_exact(shape, target, tmp_path):
    """One per-tensor scale written into every block (or channel) gives the same values."""
    x = randn(shape, 4, scale=2.0)
    src = ts.Float8CurrentScalingQuantizer(E4M3)(x)
    ts.save_quantized({"w.weight": src}, tmp_path / "src")
    rep = tc.convert(tmp_path / "src", tmp_path / "dst", rules={"*": target})
    assert rep["w.weight"].label == "lossless" and rep["w.weight"].method in ("relayout", "copy")
    got, _ = _read_output(tmp_path / "dst", rep.target_layout)
    for u, v in got["w.weight"].items():
        want = tc.values(src, u if u != "plain" else None)
        assert torch.equal(v.view(torch.int32), want.view(torch.int32)), u


def test_deepseek_ue8m0_scales(tmp_path):
    """DeepSeek-V3.1-style ``scale_fmt: ue8m0`` (power-of-two scales, as F32 or as F8_E8M0 bytes)."""
    from safetensors.torch import save_file
    w = randn((256, 256), 3).float()
    e = torch.tensor([[120, 121], [122, 119]], dtype=torch.uint8)  # 2^(E-127)
    scale = torch.exp2(e.float() - 127)
    q = (w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(-448, 448).to(E4M3)
    for name, s in (("f32", scale), ("e8m0", e.view(torch.float8_e8m0fnu))):
        root = tmp_path / name
        root.mkdir()
        save_file({"l.weight": q, "l.weight_scale_inv": s}, str(root / "model.safetensors"))
        (root / "config.json").write_text(json.dumps({"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic"}}))
        with tc.open_source(root) as srcs:
            t = srcs.load("l.weight")
            assert t.quantizer.force_pow_2_scales
            assert torch.equal(tc.values(t), deepseek_dequantize(q, scale))


def test_mxfp8_2d_rowwise_and_columnwise_bytes_are_the_same():
    x = randn((128, 256), 8, scale=3.0)
    b = recipe_quantizer("mxfp8_2d")(x).buffers()
    assert torch.equal(b["_rowwise_data"], b["_columnwise_data"])


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block_1d", "nvfp4"])
def test_missing_usage_of_1d_formats_is_requantized_and_labelled_lossy(recipe, tmp_path):
    x = randn((256, 384), 6)
    ts.save_quantized({"w.weight": recipe_quantizer(recipe, columnwise=False)(x)}, tmp_path / "src")
    rep = tc.convert(tmp_path / "src", tmp_path / "dst", recipe=recipe, usages="both")
    t = rep["w.weight"]
    assert t.label == "lossy" and "columnwise" in t.note and t.snr_db > 10
    src = ts.load_quantized(tmp_path / "src")["w.weight"].buffers()
    out = ts.load_quantized(tmp_path / "dst")["w.weight"].buffers()
    for name, b in src.items():  # the rowwise bytes are kept exactly
        assert torch.equal(out[name], b), name
    rep = tc.convert(tmp_path / "src", tmp_path / "dst2", recipe=recipe)  # default: the source's usages
    assert rep["w.weight"].label == "lossless" and rep["w.weight"].method == "copy"


def test_same_recipe_is_byte_identical(tmp_path):
    sd = _te_source_dict("nvfp4_2d")
    ts.save_quantized(sd, tmp_path / "a")
    rep = tc.convert(tmp_path / "a", tmp_path / "b", recipe="nvfp4_2d", max_shard_size="50KB")
    assert rep.lossless
    a, b = ts.load_quantized(tmp_path / "a"), ts.load_quantized(tmp_path / "b")
    for n, t in a.items():
        if isinstance(t, tsf.QuantizedTensor):
            assert b[n].quantizer == t.quantizer
            for k, v in t.buffers().items():
                assert torch.equal(b[n].buffers()[k], v), (n, k)
        else:
            assert torch.equal(b[n], t)
    assert len(list((tmp_path / "b").glob("model-*.safetensors"))) > 1
    assert ts.verify(tmp_path / "b") > 0


# --- rules, layouts, destinations -----------------------------------------------------------------

@pytest.fixture()
def plain_dir(tmp_path):
    from safetensors.torch import save_file
    (tmp_path / "hf").mkdir()
    save_file(plain_state_dict(), str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path / "hf"


def test_default_rules_keep_embeddings_head_norms_and_non_float(plain_dir, tmp_path):
    rep = tc.convert(plain_dir, tmp_path / "o", recipe="fp8_block")
    methods = {t.name: t.method for t in rep.tensors}
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
              "model.position_ids", "model.layers.0.rotary.inv_freq"):
        assert methods[n] == "keep", n
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.0.mlp.down_proj.weight"):
        assert methods[n] == "quantize", n


def test_rules_glob_first_match_and_files(plain_dir, tmp_path):
    rules = {"*.mlp.up_proj.weight": "nvfp4_2d", "*.mlp.*": "keep", "*norm*": "keep", "*.weight": "mxfp8",
             "*inv_freq": "bf16"}
    rep = tc.convert(plain_dir, tmp_path / "o", rules=rules)
    assert rep["model.layers.0.mlp.up_proj.weight"].target == "nvfp4_2d/row+col"
    assert rep["model.layers.0.mlp.down_proj.weight"].method == "keep"
    assert rep["model.layers.0.self_attn.q_proj.weight"].target == "mxfp8/row+col"
    assert rep["model.embed_tokens.weight"].target == "mxfp8/row+col"  # explicit rules: no default exclusions
    assert rep["model.layers.0.rotary.inv_freq"].target == "bf16" and rep["model.layers.0.rotary.inv_freq"].method == "cast"
    assert rep["model.position_ids"].method == "keep"
    text = tmp_path / "rules.txt"
    text.write_text("# comment\n*.up_proj.weight   nvfp4_2d\n*.weight = keep\n")
    rep = tc.convert(plain_dir, tmp_path / "o2", rules=text)
    assert rep["model.layers.0.mlp.up_proj.weight"].target.startswith("nvfp4_2d")
    assert rep["model.layers.0.self_attn.q_proj.weight"].method == "keep"
    js = tmp_path / "rules.json"
    js.write_text(json.dumps([["*q_proj.weight", "fp8_current"]]))
    assert tc.convert(plain_dir, tmp_path / "o3", rules=js)["model.layers.0.self_attn.q_proj.weight"].method == "quantize"


def test_rule_errors_name_the_tensor(plain_dir, tmp_path):
    with pytest.raises(ConversionError, match="down_proj") as e:
        tc.convert(plain_dir, tmp_path / "o", rules={"*.mlp.*": "mxfp8"})  # 200x300 is not MXFP8-shaped
    assert "tensor='model.layers.0.mlp.down_proj.weight'" in str(e.value)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    with pytest.raises(ConversionError, match="different checkpoint layouts"):
        tc.convert(plain_dir, tmp_path / "o", rules={"*q_proj*": "mxfp8", "*up_proj*": "deepseek_fp8"})
    with pytest.raises(ConversionError, match="unknown target"):
        tc.convert(plain_dir, tmp_path / "o", recipe="mxfp9")
    with pytest.raises(ConversionError, match="2-D"):
        tc.convert(plain_dir, tmp_path / "o", rules={"*layernorm*": "deepseek_fp8"})


def test_destinations(plain_dir, tmp_path):
    tc.convert(plain_dir, tmp_path / "o", recipe="mxfp8")
    with pytest.raises(ConversionError, match="not empty"):
        tc.convert(plain_dir, tmp_path / "o", recipe="mxfp8")
    first = set(p.name for p in (tmp_path / "o").iterdir())
    tc.convert(plain_dir, tmp_path / "o", recipe="nvfp4", overwrite=True)
    after = set(p.name for p in (tmp_path / "o").iterdir())
    assert not (first & after) - {"te_serial.msgpack"}  # the old shards are gone
    assert ts.load_quantized(tmp_path / "o")["model.layers.0.mlp.up_proj.weight"].quantizer.kind == "nvfp4"
    with pytest.raises(ConversionError, match="is the source"):
        tc.convert(plain_dir, plain_dir, recipe="mxfp8", overwrite=True)
    with pytest.raises(ConversionError, match="model directory"):
        tc.convert(plain_dir, tmp_path / "x.safetensors", recipe="deepseek_fp8")
    rep = tc.convert(plain_dir, tmp_path / "plain.safetensors", recipe="fp16")
    assert rep.target_layout == "safetensors"
    with safe_open(str(tmp_path / "plain.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float16


def test_failure_leaves_no_partial_output(tmp_path):
    sd = _te_source_dict("mxfp8")
    ts.save_quantized(sd, tmp_path / "src")
    shard = next((tmp_path / "src").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x55  # the last buffer's bytes no longer match their checksum
    shard.write_bytes(bytes(data))
    with pytest.raises(tse.ChecksumError):
        tc.convert(tmp_path / "src", tmp_path / "dst", recipe="fp8_block", max_shard_size="10KB")
    assert not any((tmp_path / "dst").iterdir())


def test_report_json_and_table(plain_dir, tmp_path):
    rep = tc.convert(plain_dir, tmp_path / "o", recipe="mxfp8", report=tmp_path / "r.json")
    back = tc.ConversionReport.load(tmp_path / "r.json")
    assert [t.to_dict() for t in back.tensors] == [t.to_dict() for t in rep.tensors]
    doc = json.loads((tmp_path / "r.json").read_text())  # strict JSON: no NaN/Infinity literals
    assert doc["counts"] == {"lossless": 6, "exact codes": 0, "lossy": 2, "dropped": 0} and not doc["lossless"]
    assert doc["tensors"][0]["snr_db"] == "inf"
    table = str(rep)
    for t in rep.tensors:
        assert t.name in table
    assert "lossy" in table and "SNR dB" in table and rep.summary() in table


def test_progress_callback(plain_dir, tmp_path):
    calls = []
    tc.convert(plain_dir, tmp_path / "o", recipe="fp8_current", progress=lambda d, t, n: calls.append((d, t, n)))
    assert calls[0][0] == 0 and calls[-1][0] == calls[-1][1] > 0
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)
    assert len(calls) == len(plain_state_dict()) + 2      # the start, each tensor, the end
    assert calls[-1] == (calls[-1][1], calls[-1][1], "")   # ends at 100 %, whatever was dropped


def test_tied_tensors_stay_tied(tmp_path):
    w = recipe_quantizer("fp8_block")(randn((256, 256), 1))
    ts.save_quantized({"embed.weight": w, "lm_head.weight": w, "x.weight": randn((128, 128), 2)}, tmp_path / "src")
    rep = tc.convert(tmp_path / "src", tmp_path / "dst", rules={"*": "fp8_block_1d"})
    assert rep["lm_head.weight"].method == "tied" and rep["lm_head.weight"].label == "lossless"
    ck = ts.open(tmp_path / "dst")
    assert ck.manifest.aliases  # stored once
    out = ts.load_quantized(tmp_path / "dst")
    assert out["embed.weight"] is out["lm_head.weight"]


def test_module_is_callable_and_layout_only_conversion(tmp_path):
    root = tmp_path / "ds"
    ref = deepseek_checkpoint(root)
    rep = tc.convert(root, tmp_path / "te")  # no recipe: keep everything, in te-serial
    assert rep.lossless and rep.target_layout == "te-serial"
    out = ts.load_quantized(tmp_path / "te")
    for n, v in ref.items():
        assert torch.equal(tc.values(out[n]).view(torch.int32), v.view(torch.int32)), n


def test_estimate_bytes_matches_conversion(plain_dir, tmp_path):
    est = tc.estimate_bytes(plain_dir, "nvfp4_2d")
    rep = tc.convert(plain_dir, tmp_path / "o", recipe="nvfp4_2d")
    assert est == {t.name: t.dst_bytes for t in rep.tensors}


def test_delayed_scaling_target_scale_from_amax(plain_dir, tmp_path):
    tc.convert(plain_dir, tmp_path / "o", recipe="fp8_delayed")
    t = ts.load_quantized(tmp_path / "o")["model.layers.0.mlp.up_proj.weight"]
    amax = float(plain_state_dict()["model.layers.0.mlp.up_proj.weight"].float().abs().max())
    assert t.quantizer.amax == pytest.approx(amax) and t.quantizer.scale == pytest.approx(448 / amax, rel=1e-6)
