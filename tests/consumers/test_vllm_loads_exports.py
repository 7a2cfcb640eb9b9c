"""vLLM (0.33.0, its real LlamaForCausalLM, weight loaders and post-load processing, on CPU; see
vllm_harness.py for the kernel-choice stubs) loads te-serial's serving exports of a tiny Llama and
holds, per fused GEMM, the values te-serial says the export has.

vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj and applies ONE tensor scale per
fused module: ModelOpt NVFP4 the max of the shards' weight_scale_2, compressed-tensors NVFP4
1 / max of the shards' weight_global_scale, per-tensor FP8 the max weight_scale (the other shards
requantized to it). An NVFP4 export whose fused members carry unequal tensor scales is served
with wrong values, an FP8 one with requantized values; ``test_harness_sees_unshared_fused_scales``
checks that this harness notices. te-serial quantizes a group's members with one shared scale;
FP8 members copied with their own scales it keeps, and reports how far vLLM's requantization moves
them (``test_vllm_requantizes_fp8_members_kept_with_their_own_scales``).

te-serial's values: the export imported back with te-serial (``convert(export, back)``, no recipe)
and dequantized with ``te_serial.conversion.values``. Bit-equal in fp32, except NVFP4, where the
global scale is applied with a different fp32 formula (te-serial ``(s·amax)·(1/2688)``, vLLM
``code·(s·g)``): there each element is held to the ulp bound te-serial's import report states
for that tensor. That bound is measured against the layout's own reader: ModelOpt's
``code·(s·weight_scale_2)`` is vLLM's formula; compressed-tensors' is ``code·(s / weight_global_scale)``
while vLLM multiplies by the fp32 ``1 / weight_global_scale``, which can land 1 ulp further.

Every export gets activation amaxes (static input scales: NVFP4 W4A4, FP8 W8A8): vLLM's W4A16
NVFP4 path picks Marlin, which the harness does not stub.

Needs vLLM: ``pip install --no-deps -c constraints.txt -r tests/consumers/requirements.txt``.
"""

from __future__ import annotations

import json

import pytest
import torch


LAYOUTS = ["modelopt_nvfp4", "compressed_tensors_nvfp4", "modelopt_fp8", "compressed_tensors_fp8_tensor",
           "compressed_tensors_fp8", "modelopt_mxfp8", "compressed_tensors_mxfp8", "modelopt_fp8_pb_wo",
           "compressed_tensors_fp8_block"]
#: vLLM module -> its members in vLLM's shard order
FUSED = {"model.layers.0.self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "model.layers.0.self_attn.o_proj": ["self_attn.o_proj"],
         "model.layers.0.mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
         "model.layers.0.mlp.down_proj": ["mlp.down_proj"]}
LINEARS = [m for ms in FUSED.values() for m in ms]
#: per-projection weight std: unequal tensor amaxes inside each fused group
STD = {"q_proj": 0.02, "k_proj": 0.06, "v_proj": 0.004, "o_proj": 0.02, "gate_proj": 0.02, "up_proj": 0.1,
       "down_proj": 0.02}
AMAX = {f"model.layers.0.{m}": 4.0 for m in LINEARS}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def ordered(x):
        i = x.float().contiguous().view(torch.int32).long()
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("vllm_consumer") / "hf"
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, mod in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in STD:
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * STD[leaf])
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vh():
    import vllm_harness
    vllm_harness._patch_vllm()  # the slow vLLM import, once per module
    return vllm_harness


def _export_and_import_back(src, out, layout, **kw):
    tc = pytest.importorskip("te_serial.conversion")
    import te_serial as ts
    tc.convert(src, out, recipe=layout, activation_amax=AMAX, **kw)
    back_rep = tc.convert(out, out.with_name(out.name + "-back"))
    back = ts.load_quantized(out.with_name(out.name + "-back"))
    return back, back_rep, tc


def _own_scale_values(vh, export, layout, member):
    """NVFP4: vLLM's formula (vllm_values) on the export's bytes of ``member`` with the member's OWN
    global scale, as vLLM would hold it for an unfused layer (ModelOpt: weight_scale_2;
    compressed-tensors: 1 / weight_global_scale, computed in fp32 as vLLM does)."""
    from safetensors.torch import load_file
    raw = {}
    for f in sorted(export.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    p = f"model.layers.0.{member}."
    if layout.startswith("modelopt"):
        h = {"weight": raw[p + "weight"], "weight_scale": raw[p + "weight_scale"],
             "weight_global_scale": raw[p + "weight_scale_2"].to(torch.float32).reshape(())}
    else:
        h = {"weight": raw[p + "weight_packed"], "weight_scale": raw[p + "weight_scale"],
             "weight_global_scale": 1.0 / raw[p + "weight_global_scale"].to(torch.float32).max()}
    return vh.vllm_values({member: h}, member, "nvfp4")


def _compare(held, vh, layout, export, back, back_rep, tc) -> dict[str, list[dict]]:
    """Per vLLM module, per member (vLLM's shard order): how vllm_values compares with te-serial's
    values. ``ok``: every element bit-equal, or for NVFP4 within the ulp bound te-serial's import
    report states for that tensor. ``own`` (NVFP4 only): vLLM's values are vLLM's formula applied
    with the member's own global scale, i.e. fusing changed nothing."""
    nvfp4 = vh.SCHEME_OF_LAYOUT[layout] == "nvfp4"
    results = {}
    for module, members in FUSED.items():
        got = vh.vllm_values(held, module, layout)
        parts = [tc.values(back[f"model.layers.0.{m}.weight"]).float() for m in members]
        assert got.shape == (sum(p.shape[0] for p in parts), parts[0].shape[1]), (module, got.shape)
        rows, row = [], 0
        for m, want in zip(members, parts):
            g = got[row: row + want.shape[0]]
            row += want.shape[0]
            d = _ulps(want, g)
            bound = back_rep[f"model.layers.0.{m}.weight"].ulp_max if nvfp4 else 0
            r = {"member": m.split(".")[-1], "differ": int((d > 0).sum()), "of": d.numel(), "bound_ulp": bound,
                 "beyond": int((d > bound).sum()), "max_ulp": int(d.max()),
                 "max_err_over_amax": float(((g - want).abs().max() / want.abs().max()).item())}
            r["ok"] = r["beyond"] == 0
            if nvfp4:
                r["own"] = torch.equal(g, _own_scale_values(vh, export, layout, m))
            rows.append(r)
        results[module] = rows
    return results


def _figures(rows) -> list[str]:
    out = []
    for r in rows:
        f = (f"{r['member']}: {r['differ']}/{r['of']} elements differ, {r['beyond']} beyond {r['bound_ulp']} ulp "
             f"(max {r['max_ulp']} ulp, max |err|/amax {r['max_err_over_amax']:.3g})")
        if "own" in r:
            f += "; vLLM's formula with the member's own global scale: " + ("yes" if r["own"] else "NO")
        out.append(f)
    return out


@pytest.mark.consumers
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_holds_te_serial_values(layout, hf_dir, vh, tmp_path):
    back, back_rep, tc = _export_and_import_back(hf_dir, tmp_path / layout, layout)
    held = vh.load_with_vllm(tmp_path / layout)
    assert set(held) == set(FUSED), sorted(held)
    if vh.SCHEME_OF_LAYOUT[layout] == "nvfp4":
        # vllm_values' own E2M1 decoding agrees with vLLM's dequantize_to_dtype bit for bit
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype
        for module, h in held.items():
            ref = dequantize_to_dtype(h["weight"], h["weight_scale"], h["weight_global_scale"], torch.float32,
                                      16, swizzle=False)
            assert torch.equal(ref, vh.vllm_values(held, module, layout)), module
    results = _compare(held, vh, layout, tmp_path / layout, back, back_rep, tc)
    bad = {m: _figures(rows) for m, rows in results.items() if not all(r["ok"] for r in rows)}
    assert not bad, f"{layout}: vLLM holds other values than te-serial's: " + json.dumps(bad, indent=1)


@pytest.fixture(scope="module")
def fp8_te_dir(hf_dir, tmp_path_factory):
    """A te-serial per-tensor FP8 checkpoint of ``hf_dir`` whose every weight has its own scale (as
    TE training, ModelOpt and llm-compressor give them): q/k/v and gate/up hold unequal scales."""
    transformers = pytest.importorskip("transformers")
    import te_serial as ts
    path = tmp_path_factory.mktemp("vllm_consumer_fp8") / "te"
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    ts.quantize_model(model, "fp8_current", columnwise=False, fused="off")
    ts.save_quantized(model, path)
    return path


@pytest.mark.consumers
@pytest.mark.parametrize("layout", ["modelopt_fp8", "compressed_tensors_fp8_tensor"])
def test_vllm_requantizes_fp8_members_kept_with_their_own_scales(layout, fp8_te_dir, vh, tmp_path):
    """Per-tensor FP8 members copied with their own scales (te-serial's default export: the bytes it
    holds) are requantized by vLLM's own post-load processing to the fused group's largest scale:

    - each member's values move from te-serial's by exactly the figure the export's report gives
      for that route (nothing for the member whose scale is the group's, nor for the unfused o_proj /
      down_proj, which vLLM holds as te-serial does);
    - vLLM holds the values it holds for ``fused="shared"`` (te-serial requantizing the members
      itself, its earlier default), except where vLLM's own dequantization, in FP16
      (``per_tensor_dequantize``), rounds a member's value before requantizing it."""
    tc = pytest.importorskip("te_serial.conversion")
    from te_serial.conversion.fused_scales import ENGINE_REQUANTIZE_ROUTE
    import te_serial as ts
    rep = tc.convert(fp8_te_dir, tmp_path / "own", recipe=layout, activation_amax=AMAX)
    tc.convert(fp8_te_dir, tmp_path / "shared", recipe=layout, activation_amax=AMAX, fused="shared")
    own, shared = vh.load_with_vllm(tmp_path / "own"), vh.load_with_vllm(tmp_path / "shared")
    te = ts.load_quantized(fp8_te_dir)
    moved = 0
    for module, members in FUSED.items():
        got, got_shared = vh.vllm_values(own, module, layout), vh.vllm_values(shared, module, layout)
        row = 0
        for m in members:
            name = f"model.layers.0.{m}.weight"
            t = te[name]
            want = tc.values(t).float()
            part, part_shared = got[row: row + want.shape[0]], got_shared[row: row + want.shape[0]]
            row += want.shape[0]
            assert rep[name].label == "lossless" and rep[name].method == "copy", rep[name]
            change = float((part - want).abs().max())
            assert rep[name].routes.get(ENGINE_REQUANTIZE_ROUTE, 0.0) == change, (name, rep[name].routes, change)
            moved += change > 0
            b = t.buffers()
            # vLLM's per_tensor_dequantize: the code times the member's 0-d scale, in FP16
            fp16_rounds = (b["_data"].to(torch.float16) * b["_scale_inv"].reshape(())).float() != want
            differ = part != part_shared
            assert not (differ & ~fp16_rounds).any(), (name, int(differ.sum()), int((differ & ~fp16_rounds).sum()))
    assert moved == 3  # two of q/k/v, one of gate/up
    assert any("requantize_with_max_scale" in n for n in rep.notes), rep.notes


@pytest.mark.consumers
@pytest.mark.parametrize("layout", ["modelopt_nvfp4", "compressed_tensors_nvfp4", "modelopt_fp8",
                                    "compressed_tensors_fp8_tensor"])
def test_harness_sees_unshared_fused_scales(layout, hf_dir, vh, tmp_path):
    """Negative control: with te-serial's fused-scale sharing off, q/k/v (and gate/up) keep their own
    tensor scales; vLLM applies one per fused module, so all but one member come out wrong, while
    the unfused o_proj / down_proj keep their own scale."""
    back, back_rep, tc = _export_and_import_back(hf_dir, tmp_path / layout, layout, fused="off")
    held = vh.load_with_vllm(tmp_path / layout)
    results = _compare(held, vh, layout, tmp_path / layout, back, back_rep, tc)
    key = "own" if vh.SCHEME_OF_LAYOUT[layout] == "nvfp4" else "ok"
    for module, rows in results.items():
        right = [r[key] for r in rows]
        if len(rows) > 1:
            assert right.count(True) == 1, (module, _figures(rows))   # the member with the kept scale
        else:
            assert right == [True], (module, _figures(rows))
