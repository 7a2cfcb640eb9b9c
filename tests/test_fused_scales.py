"""Fused groups share one tensor scale (te_serial.fusion, conversion/fused_scales.py).

Serving engines fuse q/k/v and gate/up into one GEMM and apply ONE tensor-wide scale: NVFP4's
global scale as they find it (members with their own are served wrong), per-tensor FP8's after
requantizing the members to the largest. Here: ``quantize(x, tensor_amax=a)`` against the
independent oracle written from TE's formulas, the fusion table and its rule, ``quantize_model``
/ ``load_into`` / ``convert`` giving each group one amax, re-expressing a TE checkpoint's unequal
NVFP4 members on export (honestly labelled), FP8 members copied with their own scales (the
engines' requantization reported per tensor; ``fused="shared"`` re-expresses them too), and the
guard that never writes an NVFP4 group with unequal scales."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

import te_serial as ts
from te_serial import fusion
from te_serial.conversion import convert
from te_serial.conversion.fused_scales import ENGINE_REQUANTIZE_ROUTE
from te_serial.errors import ConversionError, FormatError
from te_serial.formats import fused
from te_serial.recipes import recipe_quantizer
from helpers import INPUT_KINDS, assert_same_buffers, make_input
from reference.te_reference import amax_ignore_nan, ref_float8_current, ref_nvfp4

transformers = pytest.importorskip("transformers")
E4M3 = torch.float8_e4m3fn
Q, K, V = (f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj"))
GATE, UP = "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"
O_PROJ = "model.layers.0.self_attn.o_proj"
LINEARS = [Q, K, V, O_PROJ, GATE, UP, "model.layers.0.mlp.down_proj"]


# --- quantize(x, tensor_amax=) against the oracle ---------------------------------------------------

@pytest.mark.parametrize("policy", ["eager", "fused"])
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_tensor_amax_gives_the_oracles_bytes(kind, policy):
    """A given amax replaces max|x| in the global encode scale (NVFP4) and in the scale (per-tensor
    FP8), exactly as TE computes them from its amax buffer; larger and equal amaxes, every input kind."""
    x = make_input(kind, (64, 128), torch.bfloat16, seed=3)
    own = float(amax_ignore_nan(x.float()))
    for given in {own, own * 2.5 + 1e-3, 3.0e4}:
        with fused.policy(policy):
            nv = ts.NVFP4Quantizer().quantize(x, tensor_amax=given)
            f8 = ts.Float8CurrentScalingQuantizer(E4M3).quantize(x, tensor_amax=given)
        assert_same_buffers(nv.buffers(), ref_nvfp4(x, global_amax=given), f"nvfp4 {kind} amax={given}")
        assert_same_buffers(f8.buffers(), ref_float8_current(x, E4M3, amax=given), f"fp8 {kind} amax={given}")


def test_tensor_amax_equal_to_max_abs_changes_nothing():
    x = make_input("random", (128, 256), torch.float32, seed=1)
    for q in (ts.NVFP4Quantizer(with_2d_quantization=True), ts.Float8CurrentScalingQuantizer(E4M3)):
        a, b = q(x), q.quantize(x, tensor_amax=x.abs().max())
        assert_same_buffers(b.buffers(), a.buffers(), type(q).__name__)


def test_tensor_amax_is_refused_where_the_format_has_none():
    x = torch.randn(64, 64)
    for q in (ts.MXFP8Quantizer(E4M3), ts.Float8BlockQuantizer(E4M3, block_scaling_dim=2),
              ts.Float8Quantizer(1.0, 0.0, E4M3), ts.NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)):
        assert not q.takes_tensor_amax()
        with pytest.raises(FormatError, match="no tensor-wide amax"):
            q.quantize(x, tensor_amax=1.0)
    for bad in (float("nan"), -1.0):
        with pytest.raises(FormatError, match="tensor_amax"):
            ts.NVFP4Quantizer().quantize(x, tensor_amax=bad)


# --- the table -------------------------------------------------------------------------------------

def test_fused_groups_by_architecture_and_user_rule():
    names = [f"{m}.weight" for m in LINEARS] + ["model.layers.1.self_attn.q_proj.weight",
                                                "model.layers.1.self_attn.k_proj.weight"]
    llama = fusion.groups_for("LlamaForCausalLM")
    assert fusion.fused_groups(names, llama) == [(f"{Q}.weight", f"{K}.weight", f"{V}.weight"),
                                                 (f"{GATE}.weight", f"{UP}.weight")]  # layer 1 lacks v_proj
    moe = [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(2) for w in ("w1", "w2", "w3")]
    assert len(fusion.fused_groups(moe, fusion.groups_for("MixtralForCausalLM"))) == 2
    assert fusion.fused_groups(moe, llama) == []
    mla = ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
           "model.layers.0.self_attn.q_b_proj.weight"]
    assert fusion.fused_groups(mla, fusion.groups_for("DeepseekV3ForCausalLM")) == [tuple(mla[:2])]
    assert fusion.groups_for("SomethingNew") == fusion.ALL_GROUPS     # unknown: every known group applies
    assert fusion.groups_for("LlamaForCausalLM", "off") == ()
    own = fusion.groups_for(None, [["wq", "wk", "wv"]])
    assert fusion.fused_groups(["a.wq.weight", "a.wk.weight", "a.wv.weight"], own) == [
        ("a.wq.weight", "a.wk.weight", "a.wv.weight")]
    for bad in ("sometimes", [["q_proj"]], [["a.b", "c"]], [["x", "x"]]):
        with pytest.raises(ConversionError, match="fused"):
            fusion.groups_for(None, bad)


def test_which_copies_an_export_requantizes_to_the_groups_scale():
    """The one rule (``Quantizer.shares_fused_scale``, through ``fusion.requantizes_copies``): NVFP4
    members copied with their own global scale are requantized to the group's by default; per-tensor
    FP8 ones only with "shared" (engines requantize them at load); none with "off"; formats without
    a tensor-wide scale never."""
    nv, f8 = ts.NVFP4Quantizer(), ts.Float8CurrentScalingQuantizer(E4M3)
    row_scaled = ts.NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)
    assert nv.shares_fused_scale() and not f8.shares_fused_scale() and not row_scaled.shares_fused_scale()
    rules = ("auto", "shared", "off", None, [["wq", "wk", "wv"]])
    assert [fusion.requantizes_copies(nv, r) for r in rules] == [True, True, False, False, True]
    assert [fusion.requantizes_copies(f8, r) for r in rules] == [False, True, False, False, False]
    for q in (row_scaled, ts.MXFP8Quantizer(E4M3), ts.Float8Quantizer(1.0, 0.0, E4M3)):
        assert not fusion.requantizes_copies(q, "shared") and not fusion.checks_scale(q, "off")
    # an export checks NVFP4 groups even with "off" (to warn), FP8 groups only where it requantizes copies
    assert fusion.checks_scale(nv, "off") and not fusion.checks_scale(f8, "auto") and fusion.checks_scale(f8, "shared")


# --- quantize_model, load_into, convert -----------------------------------------------------------

def _llama(path=None, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # members of very different sizes: each one's own amax differs
        m.get_submodule(K).weight.mul_(3.0)
        m.get_submodule(V).weight.mul_(0.2)
        m.get_submodule(UP).weight.mul_(5.0)
    if path is not None:
        m.save_pretrained(path)
    return m


def _tensor_scale(t):
    b = t.buffers()
    return b["_amax_rowwise"] if "_amax_rowwise" in b else b["_scale_inv"]


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4_2d", "fp8_current"])
def test_quantize_model_gives_each_fused_group_its_largest_amax(recipe):
    m = ts.quantize_model(_llama(), recipe, columnwise=False)
    ref = _llama()
    w = {n: m.get_submodule(n).weight for n in LINEARS}
    for group in ((Q, K, V), (GATE, UP)):
        amax = max(float(ref.get_submodule(n).weight.detach().float().abs().max()) for n in group)
        want = recipe_quantizer(recipe, columnwise=False).quantize(ref.get_submodule(group[0]).weight.detach(),
                                                                     tensor_amax=amax)
        assert len({float(_tensor_scale(w[n])) for n in group}) == 1
        assert torch.equal(_tensor_scale(w[group[0]]), _tensor_scale(want))
        assert_same_buffers(w[group[0]].buffers(), want.buffers(), group[0])
    # o_proj is in no group: its own amax
    own = recipe_quantizer(recipe, columnwise=False)(ref.get_submodule(O_PROJ).weight.detach())
    assert_same_buffers(w[O_PROJ].buffers(), own.buffers(), O_PROJ)
    off = ts.quantize_model(_llama(), recipe, columnwise=False, fused="off")
    assert len({float(_tensor_scale(off.get_submodule(n).weight)) for n in (Q, K, V)}) == 3


def test_block_scaled_recipes_are_unchanged_by_fusion():
    m = ts.quantize_model(_llama(), "mxfp8", columnwise=False)
    ref = _llama()
    own = recipe_quantizer("mxfp8", columnwise=False)(ref.get_submodule(K).weight.detach())
    assert_same_buffers(m.get_submodule(K).weight.buffers(), own.buffers(), K)


def test_quantize_on_load_shares_like_quantize_model(tmp_path):
    from accelerate import init_empty_weights
    ref = ts.quantize_model(_llama(tmp_path / "hf"), "nvfp4", columnwise=False)
    with init_empty_weights():
        meta = transformers.LlamaForCausalLM(ref.config).to(torch.bfloat16)
    ts.quantize_model(meta, "nvfp4", columnwise=False)
    ts.load_into(meta, tmp_path / "hf")
    for n in LINEARS:
        assert_same_buffers(meta.get_submodule(n).weight.buffers(), ref.get_submodule(n).weight.buffers(), n)
    assert any("shared amax" in note for note in meta.te_serial_report.notes)


SHARED = {"modelopt_nvfp4": ("weight_scale_2", "input_scale"), "compressed_tensors_nvfp4": ("weight_global_scale",
          "input_global_scale"), "modelopt_fp8": ("weight_scale", "input_scale"),
          "compressed_tensors_fp8_tensor": ("weight_scale", "input_scale")}


@pytest.mark.parametrize("layout", sorted(SHARED))
def test_convert_from_bf16_writes_one_scale_per_fused_group(layout, tmp_path):
    _llama(tmp_path / "hf")
    # k_proj's input amax differs: one input scale for the group, the largest (as engines take it)
    amax = {n: (7.0 if n == K else 4.0) for n in LINEARS}
    rep = convert(tmp_path / "hf", tmp_path / "out", recipe=layout, activation_amax=amax)
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    for group in ((Q, K, V), (GATE, UP)):
        for key in SHARED[layout]:
            vals = [sd[f"{n}.{key}"] for n in group]
            assert all(torch.equal(v, vals[0]) for v in vals), (group, key)
    assert not torch.equal(sd[f"{Q}.{SHARED[layout][0]}"], sd[f"{O_PROJ}.{SHARED[layout][0]}"])
    assert any("shared amax" in n for n in rep.notes)


def _te_checkpoint(path, recipe="nvfp4"):
    m = _llama(path / "hf")
    q = recipe_quantizer(recipe, columnwise=False)
    sd = {n: (q(p.detach()) if n.endswith("proj.weight") else p.detach()) for n, p in m.state_dict().items()}
    ts.save_quantized(sd, path / "te")
    (path / "te" / "config.json").write_text(json.dumps(m.config.to_dict()))
    return sd


def _amax_giving_scale_inv(scale_inv: float) -> float:
    """An fp32 amax whose per-tensor FP8 scale_inv (the oracle's compute_scale_from_amax) is
    ``scale_inv`` bit for bit, searched near 448 · scale_inv."""
    c = torch.tensor(448.0 * scale_inv, dtype=torch.float32)
    cands = [c]
    lo = hi = c
    for _ in range(16):
        lo, hi = torch.nextafter(lo, torch.tensor(0.0)), torch.nextafter(hi, torch.tensor(float("inf")))
        cands += [lo, hi]
    want = torch.tensor([scale_inv], dtype=torch.float32)
    for a in cands:
        if torch.equal(ref_float8_current(torch.zeros(1, 1), E4M3, amax=float(a))["_scale_inv"], want):
            return float(a)
    raise AssertionError(f"no fp32 amax gives scale_inv {scale_inv!r}")


@pytest.mark.parametrize("recipe,layout", [("nvfp4", "modelopt_nvfp4"), ("nvfp4", "compressed_tensors_nvfp4"),
                                           ("fp8_current", "modelopt_fp8"),
                                           ("fp8_current", "compressed_tensors_fp8_tensor")])
def test_te_checkpoint_with_unequal_members_is_reexpressed_on_export(recipe, layout, tmp_path):
    """A TE-trained checkpoint's q/k/v carry their own scales: NVFP4 by default, per-tensor FP8 with
    fused="shared", the export keeps the bytes of the member whose scale is the group's (the
    largest), requantizes the others with the amax that gives that scale, labels them lossy with
    figures, and writes the values of that requantization (checked against the oracle); te-serial
    itself keeps its bytes."""
    sd = _te_checkpoint(tmp_path, recipe)
    rep = convert(tmp_path / "te", tmp_path / "out", recipe=layout, activation_amax={n: 4.0 for n in LINEARS},
                  fused="auto" if recipe == "nvfp4" else "shared")
    by = {t.name: t for t in rep.tensors}
    convert(tmp_path / "out", tmp_path / "back")
    back = ts.load_quantized(tmp_path / "back")
    for group in ((Q, K, V), (GATE, UP)):
        src = {n: sd[f"{n}.weight"] for n in group}
        vals = {n: src[n].dequantize(torch.float32) for n in group}
        if recipe == "nvfp4":
            own = {n: float(src[n].buffers()["_amax_rowwise"]) for n in group}
            amax = max(own.values())
            top = max(group, key=own.get)
        else:   # per-tensor FP8 records no amax: the largest scale_inv is the group's
            inv = {n: float(src[n].buffers()["_scale_inv"]) for n in group}
            top = max(group, key=inv.get)
            amax = _amax_giving_scale_inv(inv[top])
        for n in group:
            r = by[f"{n}.weight"]
            if n == top:  # the member whose scale is the group's: its bytes as they are
                assert r.method == "copy" and r.label in ("lossless", "exact codes"), r
                continue
            assert r.method == "requantize" and r.label == "lossy" and r.max_abs_err > 0, r
            assert "shared amax" in r.note
            got = back[f"{n}.weight"]
            if recipe == "nvfp4":
                want = ref_nvfp4(vals[n], columnwise=False, global_amax=amax)
                assert torch.equal(got.buffers()["_rowwise_data"], want["_rowwise_data"]), n
            else:
                want = ref_float8_current(vals[n], E4M3, columnwise=False, amax=amax)
                assert torch.equal(got.buffers()["_scale_inv"], want["_scale_inv"]), n
                assert torch.equal(got.buffers()["_data"].view(torch.uint8), want["_data"].view(torch.uint8)), n
    assert any("requantized to the group's shared amax" in note for note in rep.notes)


@pytest.mark.parametrize("layout", ["modelopt_fp8", "compressed_tensors_fp8_tensor"])
def test_te_checkpoint_fp8_members_keep_their_bytes_and_the_engines_requantization_is_reported(layout, tmp_path):
    """Per-tensor FP8 by default: every member of a fused group is copied with its own scale,
    lossless; the report says that engines requantize a fused group to its largest scale at load,
    and gives per member how far that moves its values: exactly how far fused="shared" moves them
    (te-serial's requantization), zero for the member whose scale is the group's."""
    sd = _te_checkpoint(tmp_path, "fp8_current")
    acts = {n: 4.0 for n in LINEARS}
    rep = convert(tmp_path / "te", tmp_path / "own", recipe=layout, activation_amax=acts)
    convert(tmp_path / "te", tmp_path / "shared", recipe=layout, activation_amax=acts, fused="shared")
    out = load_file(str(tmp_path / "own" / "model.safetensors"))
    shared = load_file(str(tmp_path / "shared" / "model.safetensors"))
    route = ENGINE_REQUANTIZE_ROUTE
    for group in ((Q, K, V), (GATE, UP)):
        top = max(group, key=lambda n: float(sd[f"{n}.weight"].buffers()["_scale_inv"]))
        for n in group:
            r = rep[f"{n}.weight"]
            assert (r.method, r.label) == ("copy", "lossless"), r
            src = sd[f"{n}.weight"].buffers()
            assert torch.equal(out[f"{n}.weight"].view(torch.uint8), src["_data"].view(torch.uint8)), n
            assert torch.equal(out[f"{n}.weight_scale"].float().reshape(()), src["_scale_inv"].reshape(())), n
            own_vals = out[f"{n}.weight"].float() * out[f"{n}.weight_scale"].float()
            shared_vals = shared[f"{n}.weight"].float() * shared[f"{n}.weight_scale"].float()
            if n == top:
                assert route not in r.routes and torch.equal(own_vals, shared_vals), n
            else:
                assert r.routes[route] == float((own_vals - shared_vals).abs().max()) > 0, (n, r.routes)
        assert len({float(out[f"{n}.weight_scale"].float()) for n in group}) == len(group)
    assert any("own tensor scales" in n and "q_proj+k_proj+v_proj ×1" in n and "requantize" in n for n in rep.notes)
    assert any(n.startswith(f"NOT lossless through {route}: 3 weights") for n in rep.notes), rep.notes
    assert not [n for n in rep.notes if n.startswith("WARNING")]
    with warnings.catch_warnings():  # export_tensors hands an engine the same bytes, without a warning
        warnings.simplefilter("error")
        streamed = dict(ts.export_tensors(tmp_path / "te", layout, activation_amax=acts))
    assert set(streamed) == set(out)
    assert all(torch.equal(streamed[k].reshape(-1).view(torch.uint8), out[k].reshape(-1).view(torch.uint8)) for k in out)


def test_fused_off_warns_that_engines_serve_wrong_values(tmp_path):
    _te_checkpoint(tmp_path)
    rep = convert(tmp_path / "te", tmp_path / "out", recipe="modelopt_nvfp4", fused="off")
    warn = [n for n in rep.notes if n.startswith("WARNING")]
    assert len(warn) == 2 and "will serve wrong values" in warn[0] and "weight_scale_2" in warn[0]
    assert all(t.method == "copy" for t in rep.tensors if t.name.endswith("proj.weight"))


def test_an_export_that_would_hold_unequal_scales_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    """The guard behind the sharing: if a group's scales come out unequal anyway, the export fails
    before anything is committed."""
    from te_serial.conversion import core
    _te_checkpoint(tmp_path)
    monkeypatch.setattr(core, "share_fused_amax", lambda *a, **k: ({}, []))
    with pytest.raises(ConversionError, match="unequal weight_scale_2.*wrong values"):
        convert(tmp_path / "te", tmp_path / "out", recipe="modelopt_nvfp4")
    assert not any((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True
