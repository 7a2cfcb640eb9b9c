"""Importers and exporters of other layouts, on checkpoints laid out exactly as the real formats:
DeepSeek-V3 block FP8, compressed-tensors FP8 (per-channel and per-tensor), plain HF safetensors,
and refusal of layouts te-serial does not read."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import te_serial as ts
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.errors import CheckpointError, UnknownLayoutError

from _convert_data import (DEEPSEEK_QC, E4M3, ct_checkpoint, ct_dequantize, deepseek_checkpoint,
                           deepseek_dequantize, plain_state_dict, randn)

tc = importlib.import_module("te_serial.conversion")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return root, deepseek_checkpoint(root)


@pytest.fixture(scope="module")
def ct_channel(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct_channel")
    return root, ct_checkpoint(root, "channel")


@pytest.fixture(scope="module")
def ct_tensor_static(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct_tensor")
    return root, ct_checkpoint(root, "tensor", static_input=True)


def _linear(name: str) -> bool:
    return name.endswith(("proj.weight", "mqa.weight"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


# --- DeepSeek-V3 ------------------------------------------------------------------------------

def test_deepseek_detected_and_values_exact(deepseek):
    root, ref = deepseek
    assert tc.detect_layout(root) == "deepseek_fp8"
    with tc.open_source(root) as src:
        assert set(src.tensors) == set(ref)  # scale_inv tensors are folded into their weights
        for name, want in ref.items():
            st = src.tensors[name]
            t = src.load(name)
            if _linear(name):
                assert st.fmt == "deepseek_fp8" and st.usages == "row"
                assert isinstance(t, tsf.Float8BlockwiseQTensor)
                q = t.quantizer
                assert (q.block_scaling_dim, q.rowwise, q.columnwise, q.fp8_dtype) == (2, True, False, E4M3)
                assert not q.force_pow_2_scales  # DeepSeek's scales are amax / 448, not powers of two
            else:
                assert not isinstance(t, tsf.QuantizedTensor)
            assert _same(tc.values(t), want), name


def test_deepseek_scales_for_shapes_not_multiple_of_128(deepseek):
    root, ref = deepseek
    with tc.open_source(root) as src:
        t = src.load("model.layers.0.self_attn.o_proj.weight")  # [256, 200]: two column blocks, the last partial
        assert tuple(t.shape) == (256, 200)
        s = t.buffers()["_rowwise_scale_inv"]
        assert tuple(s.shape) == (2, 4) and bool((s[:, 2:] == 0).all())  # compact, padding zeroed
        t = src.load("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")  # [72, 256]: one partial row block
        assert tuple(t.buffers()["_rowwise_scale_inv"].shape) == (1, 4)


def test_deepseek_to_te_and_back_is_byte_identical(deepseek, tmp_path):
    root, ref = deepseek
    rep = tc.convert(root, tmp_path / "te", recipe="fp8_block")
    assert rep.lossless and rep.source_layout == "deepseek_fp8"
    assert {t.method for t in rep.tensors if _linear(t.name)} == {"copy"}
    loaded = ts.load_quantized(tmp_path / "te")
    for name, want in ref.items():
        assert _same(tc.values(loaded[name]), want), name
    rep2 = tc.convert(tmp_path / "te", tmp_path / "ds", recipe="deepseek_fp8", max_shard_size="100KB")
    assert rep2.lossless and rep2.target_layout == "deepseek_fp8"
    orig = {}
    for p in root.glob("*.safetensors"):
        orig.update(load_file(str(p)))
    back = {}
    for p in (tmp_path / "ds").glob("*.safetensors"):
        back.update(load_file(str(p)))
    assert set(back) == set(orig)
    for k, v in orig.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), k
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert {k: qc[k] for k in DEEPSEEK_QC} == DEEPSEEK_QC
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    # the router stays BF16 and is named as such for engines that quantize every Linear
    assert "model.layers.1.mlp.gate" in qc.get("ignored_layers", [])
    index = json.loads((tmp_path / "ds" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(orig)


def test_deepseek_export_from_bf16_matches_reference_dequant(tmp_path):
    sd = plain_state_dict()
    (tmp_path / "hf").mkdir()
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    rep = tc.convert(tmp_path / "hf", tmp_path / "ds", recipe="deepseek_fp8")
    out = load_file(str(tmp_path / "ds" / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        w, s = out[name], out[name + "_scale_inv"]
        m, k = w.shape
        assert w.dtype == E4M3 and s.dtype == torch.float32
        assert tuple(s.shape) == (math.ceil(m / 128), math.ceil(k / 128))
        got = deepseek_dequantize(w, s)
        x = sd[name].float()
        assert rep[name].label == "lossy"
        # every block's max maps to at most 448: error ≤ half an E4M3 step at the block's top
        assert (got - x).abs().max() <= x.abs().max() / 16
        err = got - x
        assert math.isclose(rep[name].max_abs_err, float(err.abs().max()), rel_tol=1e-6)
    assert out["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_scale_inv" not in out
    qc = json.loads((tmp_path / "ds" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]


# --- compressed-tensors -----------------------------------------------------------------------

@pytest.mark.parametrize("which", ["channel", "tensor"])
def test_ct_detected_and_values_exact(which, ct_channel, ct_tensor_static):
    root, ref = ct_channel if which == "channel" else ct_tensor_static
    with tc.open_source(root) as src:
        assert src.layout == "compressed_tensors_fp8"
        assert set(src.tensors) == set(ref)
        for name, want in ref.items():
            t = src.load(name)
            if name.endswith("proj.weight"):
                assert src.tensors[name].fmt == f"ct_fp8_{which}"
                kind = "fp8_blockwise" if which == "channel" else "fp8_current_scaling"
                assert t.quantizer.kind == kind and not t.quantizer.columnwise
            assert _same(tc.values(t), want), name
        if which == "tensor":  # static activation scales are not weights: reported as dropped
            assert set(src.dropped) == {n[: -len("weight")] + "input_scale" for n in ref if n.endswith("proj.weight")}


def test_ct_export_config_and_tensors(tmp_path):
    sd = plain_state_dict()
    (tmp_path / "hf").mkdir()
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    for recipe, strategy in (("compressed_tensors_fp8", "channel"), ("compressed_tensors_fp8_tensor", "tensor")):
        dst = tmp_path / recipe
        rep = tc.convert(tmp_path / "hf", dst, recipe=recipe)
        cfg = json.loads((dst / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"] and (dst / "tokenizer.json").exists()
        qc = cfg["quantization_config"]
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
        assert qc["quantization_status"] == "compressed"
        g = qc["config_groups"]["group_0"]
        assert g["targets"] == ["Linear"]
        assert {k: g["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == \
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
        # no activation amax in a BF16 source: weight-only (W8A16), and the report says so
        assert g["input_activations"] is None
        assert any("W8A16" in n and "weight-only" in n for n in rep.notes), rep.notes
        dyn = tc.convert(tmp_path / "hf", tmp_path / f"{recipe}-dyn", recipe=recipe, activations="dynamic")
        act = json.loads((tmp_path / f"{recipe}-dyn" / "config.json").read_text())["quantization_config"][
            "config_groups"]["group_0"]["input_activations"]
        assert act["dynamic"] is True and act["strategy"] == "token"
        assert any("FP8_DYNAMIC" in n and "as asked" in n for n in dyn.notes)
        assert "lm_head" in qc["ignore"]
        out = load_file(str(dst / "model.safetensors"))
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
            w, s = out[name], out[name[: -len("weight")] + "weight_scale"]
            assert w.dtype == E4M3 and s.dtype == torch.float32
            assert tuple(s.shape) == ((w.shape[0], 1) if strategy == "channel" else (1,))
            x = sd[name].float()
            got = ct_dequantize(w, s)
            assert float((got - x).abs().max()) <= float(x.abs().max()) / 16
            assert math.isclose(rep[name].max_abs_err, float((got - x).abs().max()), rel_tol=1e-6)
        assert "model.embed_tokens.weight_scale" not in out and out["lm_head.weight"].dtype == torch.bfloat16


def test_ct_round_trips_through_te_byte_identical(ct_channel, ct_tensor_static, tmp_path):
    for (root, _), recipe, te_recipe in ((ct_channel, "compressed_tensors_fp8", "fp8_block_1d"),
                                         (ct_tensor_static, "compressed_tensors_fp8_tensor", "fp8_current")):
        te_dir, back = tmp_path / f"te-{te_recipe}", tmp_path / f"ct-{te_recipe}"
        first = tc.convert(root, te_dir, recipe=te_recipe)
        assert not first.lossy
        assert len(first.dropped) == (4 if recipe.endswith("tensor") else 0)  # the static input scales
        rep = tc.convert(te_dir, back, recipe=recipe)
        assert rep.lossless
        orig, new = {}, {}
        for p in root.glob("*.safetensors"):
            orig.update(load_file(str(p)))
        for p in back.glob("*.safetensors"):
            new.update(load_file(str(p)))
        for k, v in orig.items():
            if k.endswith("input_scale"):  # kept as the layer's activation amax, written again (static W8A8)
                assert new[k].dtype == torch.float32 and torch.equal(new[k].reshape(v.shape), v.float()), k
                continue
            if k.endswith("weight_scale"):  # BF16 scales come back as the same values in F32
                assert new[k].dtype == torch.float32 and torch.equal(new[k].reshape(v.shape), v.float())
                continue
            assert new[k].dtype == v.dtype and torch.equal(new[k].view(torch.uint8), v.view(torch.uint8)), k


def test_ct_channel_requantizes_when_rows_differ(tmp_path):
    """A TE 1×128 tensor whose row blocks have different scales is not per-channel: requantized (lossy)."""
    w = randn((256, 512), 7)
    w[:, 300:] *= 50  # the last blocks of every row get larger scales
    q = ts.Float8BlockQuantizer(E4M3, block_scaling_dim=1, force_pow_2_scales=False, columnwise=False)
    ts.save_quantized({"layer.weight": q(w)}, tmp_path / "te")
    rep = tc.convert(tmp_path / "te", tmp_path / "ct", recipe="compressed_tensors_fp8")
    t = rep["layer.weight"]
    assert t.label == "lossy" and t.method == "requantize" and "per channel" in t.note


# --- plain safetensors and te-serial sources ---------------------------------------------------

def test_plain_single_and_sharded(tmp_path):
    sd = plain_state_dict()
    single = tmp_path / "single.safetensors"
    save_file(sd, str(single))
    assert tc.detect_layout(single) == "safetensors"
    with tc.open_source(single) as src:
        for n, t in sd.items():
            got = src.load(n)
            assert got.dtype == t.dtype and torch.equal(got, t)
    from _convert_data import _write_hf
    _write_hf(tmp_path / "sharded", sd, {"architectures": ["LlamaForCausalLM"]}, shards=3)
    with tc.open_source(tmp_path / "sharded") as src:
        assert src.layout == "safetensors" and list(src.tensors) == list(sd)
        assert len(src._files) == 3 and src.config["architectures"] == ["LlamaForCausalLM"]
        assert all(torch.equal(src.load(n), sd[n]) for n in sd)
    with tc.open_source(tmp_path / "sharded" / "model.safetensors.index.json") as src:
        assert list(src.tensors) == list(sd)


def test_te_serial_source_reads_every_recipe_and_verifies_checksums(tmp_path):
    x = randn((256, 256), 0)
    sd = {name: ts.recipes.recipe_quantizer(name)(x) for name in ts.recipes.RECIPES}
    sd["bias"] = randn((256,), 1)
    ts.save_quantized(sd, tmp_path / "ck")
    with tc.open_source(tmp_path / "ck") as src:
        assert src.layout == "te-serial"
        for name, t in sd.items():
            got = src.load(name)
            assert _same(tc.values(got), tc.values(t)), name
    # a flipped byte in a shard is caught by the checksum as it is read
    shard = next((tmp_path / "ck").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(tse.ChecksumError):
        with tc.open_source(tmp_path / "ck") as src:
            for name in src.tensors:
                src.load(name)


# --- refusing what is not read ------------------------------------------------------------------

def _foreign(tmp_path, kind: str):
    root = tmp_path / kind
    root.mkdir()
    w = randn((128, 128), 0)
    cfg = None
    if kind == "gptq":
        t = {"model.layers.0.mlp.up_proj.qweight": torch.zeros(16, 128, dtype=torch.int32),
             "model.layers.0.mlp.up_proj.qzeros": torch.zeros(1, 16, dtype=torch.int32),
             "model.layers.0.mlp.up_proj.scales": torch.ones(1, 128, dtype=torch.float16)}
        cfg = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    elif kind == "awq_config_only":
        t = {"x.weight": w}
        cfg = {"quantization_config": {"quant_method": "awq"}}
    elif kind == "bnb":
        t = {"x.weight": torch.zeros(128, 128, dtype=torch.int8), "x.SCB": torch.ones(128)}
    elif kind == "fp8_without_scale":
        t = {"x.weight": w.to(E4M3)}
    elif kind == "ct_group":
        qc = json.loads(json.dumps(__import__("_convert_data").ct_qc("channel")))
        qc["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128)
        t = {"x.weight": w.to(E4M3), "x.weight_scale": torch.ones(128, 1, dtype=torch.bfloat16)}
        cfg = {"quantization_config": qc}
    elif kind == "ct_int8":
        qc = __import__("_convert_data").ct_qc("channel")
        qc["format"] = "int-quantized"
        t = {"x.weight": torch.zeros(128, 128, dtype=torch.int8), "x.weight_scale": torch.ones(128, 1)}
        cfg = {"quantization_config": qc}
    elif kind == "deepseek_bad_scale_shape":
        t = {"x.weight": w.to(E4M3), "x.weight_scale_inv": torch.ones(2, 2)}
        cfg = {"quantization_config": dict(DEEPSEEK_QC)}
    elif kind == "fp8_block_64":
        t = {"x.weight": w.to(E4M3), "x.weight_scale_inv": torch.ones(2, 2)}
        cfg = {"quantization_config": {**DEEPSEEK_QC, "weight_block_size": [64, 64]}}
    elif kind == "scale_without_weight":
        t = {"x.weight_scale_inv": torch.ones(1, 1)}
    elif kind == "mxfp4_blocks":
        t = {"experts.gate_up_proj_blocks": torch.zeros(4, 16, dtype=torch.uint8),
             "experts.gate_up_proj_scales": torch.zeros(4, 1, dtype=torch.uint8)}
    elif kind == "pickle_only":
        (root / "pytorch_model.bin").write_bytes(b"\x80\x04N.")
        return root
    elif kind == "two_files_no_index":
        save_file({"a": w}, str(root / "a.safetensors"))
        save_file({"b": w}, str(root / "b.safetensors"))
        return root
    elif kind == "empty_dir":
        return root
    else:
        raise AssertionError(kind)
    save_file(t, str(root / "model.safetensors"))
    if cfg is not None:
        (root / "config.json").write_text(json.dumps(cfg))
    return root


FOREIGN = ["gptq", "awq_config_only", "bnb", "fp8_without_scale", "ct_group", "ct_int8", "deepseek_bad_scale_shape",
           "fp8_block_64", "scale_without_weight", "mxfp4_blocks", "pickle_only", "two_files_no_index", "empty_dir"]


@pytest.mark.parametrize("kind", FOREIGN)
def test_unknown_layouts_refused_clearly(kind, tmp_path):
    root = _foreign(tmp_path, kind)
    with pytest.raises(UnknownLayoutError) as e:
        tc.detect_layout(root)
    msg = str(e.value)
    assert "\n" not in msg and "file=" in msg, msg
    with pytest.raises(UnknownLayoutError):
        tc.convert(root, tmp_path / "out", recipe="mxfp8")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_unknown_layout_messages_name_what_was_found(tmp_path):
    cases = {"gptq": "'gptq'", "awq_config_only": "'awq'", "fp8_without_scale": "without a scale",
             "ct_group": "'group'", "pickle_only": "pickle", "two_files_no_index": "index",
             "deepseek_bad_scale_shape": "128x128", "bnb": "bitsandbytes"}
    for kind, needle in cases.items():
        with pytest.raises(UnknownLayoutError, match=needle):
            tc.detect_layout(_foreign(tmp_path, kind))


def test_index_pointing_outside_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    save_file({"a": randn((4,), 0)}, str(tmp_path / "m" / "x.safetensors"))
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(CheckpointError, match="leaves the checkpoint"):
        tc.open_source(tmp_path / "m")


def test_safetensors_written_by_converter_read_by_safetensors_and_te_serial(tmp_path):
    """The streaming writer's files (header first, buffers at planned offsets, padded header for a
    single-file te-serial checkpoint) are ordinary safetensors files."""
    sd = plain_state_dict()
    save_file(sd, str(tmp_path / "in.safetensors"))
    tc.convert(tmp_path / "in.safetensors", tmp_path / "one.safetensors", recipe="mxfp8")
    with safe_open(str(tmp_path / "one.safetensors"), framework="pt") as f:
        assert "te_serial.manifest" in f.metadata()
        keys = set(f.keys())
    assert "model.layers.0.mlp.up_proj.weight._rowwise_data" in keys
    assert ts.verify(tmp_path / "one.safetensors") > 0
    loaded = ts.load_quantized(tmp_path / "one.safetensors")
    assert isinstance(loaded["model.layers.0.mlp.up_proj.weight"], tsf.MXFP8Tensor)
    assert torch.equal(loaded["model.position_ids"], sd["model.position_ids"])
