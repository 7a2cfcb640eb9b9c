"""MoE end to end (issue 36): transformers 5's 3-D expert parameters are quantized weights.

Checked against transformers' own MoE classes (Qwen3-MoE, Mixtral, DeepSeek-V3 from tiny configs;
the three expert implementations), the independent reference oracle for each expert's bytes, and
the per-expert checkpoints ``save_pretrained`` and ``convert`` write.
"""

from __future__ import annotations

import collections
from pathlib import Path
import json
import re

import pytest
import torch

import te_serial as ts
from te_serial.errors import ConversionError, FormatError
from te_serial.formats import QuantizedTensor
from te_serial.formats.grouped import GroupedQuantizer, GroupedTensor
from te_serial.formats.slicing import join_rows, slice_quantized
from te_serial.precision import high_precision_reason
from te_serial.recipes import recipe_quantizer

from helpers import assert_same_tensor
from reference import te_reference as ref

transformers = pytest.importorskip("transformers")

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def qwen3_moe_config():
    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)


def mixtral_config():
    return transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


def deepseek_v3_config():
    return transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1)


def gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2)


CONFIGS = {"qwen3_moe": qwen3_moe_config, "mixtral": mixtral_config, "deepseek_v3": deepseek_v3_config,
           "gpt_oss": gpt_oss_config}
#: the architectures whose checkpoints name each expert (gpt-oss keeps 3-D names)
PER_EXPERT = ("qwen3_moe", "mixtral", "deepseek_v3")
RECIPES = ("mxfp8", "nvfp4", "fp8_current", "fp8_block_1d")


def build(arch: str, seed: int = 0, device: str = "cpu"):
    """A tiny model of ``arch`` in BF16; its experts adversarial: experts far apart in magnitude
    (per-expert scales must differ), one expert all zero."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.bfloat16)
    if device == "meta":
        return model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3:
                for i in range(p.shape[0]):
                    p[i].mul_(10.0 ** ((i % 5) - 2))
                p[1].zero_()
            elif p.dim() == 1 or name.endswith("bias"):  # biases and norms away from their init
                p.add_(torch.randn_like(p) * 0.1)
    return model


def expert_stacks(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.dim() == 3}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def same_tensors(a, b) -> bool:
    if isinstance(a, QuantizedTensor) or isinstance(b, QuantizedTensor):
        return (type(a) is type(b) and a.quantizer == b.quantizer and a.shape == b.shape
                and set(a.buffers()) == set(b.buffers())
                and all(same_bytes(x, b.buffers()[k]) for k, x in a.buffers().items()))
    return a.dtype == b.dtype and same_bytes(a.detach(), b.detach())


def assert_same_model(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert list(pa) == list(pb)
    bad = [n for n in pa if not same_tensors(pa[n], pb[n])]
    assert not bad, bad[:5]


def dequantized_copy(model, arch):
    plain = build(arch)
    state = {n: (p.dequantize() if isinstance(p, QuantizedTensor) else p.detach())
             for n, p in model.state_dict(keep_vars=True).items()}
    plain.load_state_dict(state)
    return plain


# --- the rule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,shape,why", [
    ("model.layers.0.mlp.experts.gate_up_proj", (8, 128, 64), None),
    ("model.layers.0.mlp.experts.down_proj", (8, 64, 64), None),
    ("model.layers.0.mlp.experts.gate_up_proj_bias", (8, 128), "not a 2-D"),
    ("model.layers.0.mlp.experts.gate_up_proj_bias", (8, 1, 128), "3-D, not a stack"),
    ("model.layers.0.mlp.experts.down_proj_scale", (8, 4, 2), "3-D, not a stack"),
    ("model.layers.0.conv.weight", (8, 4, 3), "3-D, not a stack"),
    ("model.layers.0.mlp.gate.weight", (8, 64), "a MoE router"),
    ("model.layers.0.mlp.shared_expert_gate.weight", (1, 64), "a MoE router"),
    ("model.layers.0.mlp.shared_expert.up_proj.weight", (64, 64), None),
    ("model.embed_tokens.weight", (128, 64), "an embedding"),
    ("lm_head.weight", (128, 64), "an output head"),
])
def test_the_rule_says_why(name, shape, why):
    got = high_precision_reason(name, shape)
    assert (got is None) if why is None else (got is not None and got.startswith(why)), got


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_every_weight_outside_embeddings_heads_norms_and_routers_is_quantized(arch):
    model = ts.quantize_model(build(arch), "nvfp4", columnwise=False)
    for name, p in model.named_parameters():
        expected = high_precision_reason(name, tuple(p.shape)) is None
        assert isinstance(p, QuantizedTensor) is expected, name
        if p.dim() == 3 and expected:
            assert isinstance(p, GroupedTensor) and p.quantizer.num_tensors == p.shape[0], name


# --- bytes: each expert as TE's GroupedLinear quantizes its members ----------------------------

def _reference_member(recipe: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    if recipe == "mxfp8":
        return ref.ref_mxfp8(x, torch.float8_e4m3fn, rowwise=True, columnwise=False)
    if recipe == "fp8_current":
        return ref.ref_float8_current(x, torch.float8_e4m3fn, rowwise=True, columnwise=False)
    if recipe == "nvfp4":
        return ref.ref_nvfp4(x, rowwise=True, columnwise=False)
    raise AssertionError(recipe)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_current", "nvfp4"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_each_expert_has_the_reference_bytes(arch, recipe):
    model = build(arch)
    stacks = {n: p.detach().clone() for n, p in expert_stacks(model).items()}
    ts.quantize_model(model, recipe, columnwise=False)
    q = dict(model.named_parameters())
    for name, w in stacks.items():
        members = q[name].members()
        assert len(members) == w.shape[0]
        for i, member in enumerate(members):
            expected = _reference_member(recipe, w[i])
            got = member.buffers()
            for buf, value in expected.items():
                if value is None or buf not in got:
                    continue
                assert same_bytes(got[buf], value.to(got[buf].device)), (name, i, buf)
        scales = {bytes(m.buffers()[next(b for b in m.buffers() if "scale" in b)].view(torch.uint8).reshape(-1)[:4])
                  for m in members}
        assert len(scales) > 1, "experts of different magnitudes must get different scales"


# --- the forward pass: every transformers expert implementation ----------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_logits_equal_the_dequantized_model_in_every_expert_implementation(arch, recipe):
    model = ts.quantize_model(build(arch), recipe, columnwise=False)
    plain = dequantized_copy(model, arch)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    for impl in IMPLEMENTATIONS:
        model.set_experts_implementation(impl)
        plain.set_experts_implementation(impl)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain(ids).logits), impl


def test_picking_experts_dequantizes_only_those_members():
    w = torch.randn(6, 64, 32).bfloat16()
    g = GroupedQuantizer(member=recipe_quantizer("mxfp8", columnwise=False), member_shapes=[(64, 32)] * 6)
    t = g.quantize(w)
    whole = t.dequantize()
    assert torch.equal(t[3], whole[3])
    assert torch.equal(t[-1], whole[-1])
    ids = torch.tensor([[5, 0], [5, 2]])
    assert torch.equal(t[ids], whole[ids])
    assert t[torch.tensor([], dtype=torch.long)].shape == (0, 64, 32)
    with pytest.raises(IndexError):
        t[torch.tensor([6])]


# --- checkpoints ------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_save_load_and_load_into_a_meta_model(arch, recipe, tmp_path):
    model = ts.quantize_model(build(arch), recipe, columnwise=False)
    ts.save_quantized(model, tmp_path / "ckpt")
    state = ts.load_quantized(tmp_path / "ckpt")
    for name, p in model.named_parameters():
        assert same_tensors(state[name], p), name
    meta = ts.quantize_model(build(arch, device="meta"), recipe, columnwise=False)
    ts.load_into(meta, tmp_path / "ckpt")
    assert_same_model(meta, model)
    with ts.open(tmp_path / "ckpt") as ckpt:  # one expert's bytes alone
        name = next(iter(expert_stacks(model)))
        assert same_tensors(ckpt.get(name, member=2), dict(model.named_parameters())[name].members()[2])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_quantize_on_load_of_a_save_pretrained_directory_equals_quantize_model(arch, recipe, tmp_path, monkeypatch):
    from te_serial.checkpoint.files import SafetensorsFile
    src = build(arch)
    src.save_pretrained(tmp_path / "bf16")
    expected = ts.quantize_model(build(arch), recipe, columnwise=False)
    meta = ts.quantize_model(build(arch, device="meta"), recipe, columnwise=False)
    mapped, real = [], SafetensorsFile.mapped
    monkeypatch.setattr(SafetensorsFile, "mapped", lambda self, key, *a, **kw: mapped.append(key) or real(self, key, *a, **kw))
    ts.load_into(meta, tmp_path / "bf16")
    assert_same_model(meta, expected)
    assert mapped and not [k for k in mapped if re.search(r"experts\.\d+\.", k)]   # experts read into their stack


def test_tensors_loaded_as_mapped_file_pages_hold_no_descriptor(tmp_path):
    """A model loaded from a Hugging Face directory keeps its plain tensors as mappings of the files'
    pages, one per tensor: they hold no file descriptor (a model of thousands of tensors would run out
    of them), and each mapping goes with the last tensor that uses it."""
    import gc
    import os
    build("qwen3_moe").save_pretrained(tmp_path / "bf16")

    def held() -> tuple[int, int]:
        gc.collect()
        return len(os.listdir("/proc/self/fd")), Path("/proc/self/maps").read_text().count(str(tmp_path / "bf16"))

    fds, maps = held()
    model = ts.load_into(build("qwen3_moe", device="meta"), tmp_path / "bf16")
    assert_same_model(model, build("qwen3_moe"))
    loaded_fds, loaded_maps = held()
    assert loaded_fds == fds and loaded_maps > maps + 10   # mapped, one per tensor, no descriptor each
    del model
    assert held() == (fds, maps)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_a_quantized_stacks_error_figures_are_its_worst_experts(recipe, tmp_path):
    """A BF16 stack quantized into a grouped tensor on load is measured expert by expert (never the stack's
    values at once): its report carries the worst expert's max error and relative RMSE, computed here on
    their own."""
    src = build("qwen3_moe")
    src.save_pretrained(tmp_path / "bf16")   # per-expert keys, read into transformers' 3-D stacks
    meta = ts.quantize_model(build("qwen3_moe", device="meta"), recipe, columnwise=False)
    ts.load_into(meta, tmp_path / "bf16")
    source, loaded = dict(src.named_parameters()), dict(meta.named_parameters())
    stacks = [t for t in meta.te_serial_report.tensors if isinstance(loaded.get(t.name), GroupedTensor)]
    assert len(stacks) == 4
    for t in stacks:
        x, got = source[t.name].detach().float(), loaded[t.name].dequantize(torch.float32)
        errs = [float((g - r).abs().max()) for r, g in zip(x, got)]
        rel = [float(((g - r) ** 2).sum() / (r ** 2).sum()) ** 0.5 for r, g in zip(x, got)]
        assert t.label == "lossy" and t.max_abs_err == max(errs), t.name
        assert t.rel_rmse == pytest.approx(max(rel), rel=1e-5), t.name


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_current"])
@pytest.mark.parametrize("arch", PER_EXPERT)
def test_a_converted_per_expert_checkpoint_loads_into_the_3d_experts_exactly(arch, recipe, tmp_path):
    build(arch).save_pretrained(tmp_path / "bf16")
    ts.convert(tmp_path / "bf16", tmp_path / "out", recipe=recipe)
    with ts.open(tmp_path / "out") as ckpt:
        assert any(".experts.0." in n for n in ckpt.protos)  # per-expert keys, as engines read them
    expected = ts.quantize_model(build(arch), recipe, columnwise=False)
    meta = ts.quantize_model(build(arch, device="meta"), recipe, columnwise=False)
    ts.load_into(meta, tmp_path / "out")
    assert_same_model(meta, expected)


def test_a_stack_that_would_mix_blocks_is_refused_naming_the_tensor_and_the_rule(tmp_path):
    build("qwen3_moe").save_pretrained(tmp_path / "bf16")
    ts.convert(tmp_path / "bf16", tmp_path / "out", recipe="fp8_block")  # 128×128 blocks, 64 gate rows
    meta = ts.quantize_model(build("qwen3_moe", device="meta"), "fp8_block", columnwise=False)
    with pytest.raises(ConversionError, match=r"experts\.gate_up_proj.*row blocks of 128"):
        ts.load_into(meta, tmp_path / "out")


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_block", "mxfp4"])
def test_gpt_oss_experts_stored_in_out_are_quantized_along_their_reduction_dim(recipe, tmp_path):
    """gpt-oss holds its experts [E, in, out] (``x @ w[i]``): each member is the expert's transpose,
    quantized as TE's [out, in] weight (blocks along ``in``), in a transposed group (format 1.4)."""
    stacks = {n: p.detach().clone() for n, p in expert_stacks(build("gpt_oss")).items()}
    model = ts.quantize_model(build("gpt_oss"), recipe, columnwise=False)
    params = dict(model.named_parameters())
    q = recipe_quantizer(recipe, columnwise=False)
    for name, w in stacks.items():
        t = params[name]
        assert isinstance(t, GroupedTensor) and t.quantizer.transposed and t.shape == w.shape
        assert t.quantizer.member_shapes[0] == (w.shape[2], w.shape[1])
        for i, member in enumerate(t.members()):
            alone = q.quantize(w[i].t().contiguous())
            assert all(same_bytes(b, alone.buffers()[k]) for k, b in member.buffers().items()), (name, i)
    ts.save_quantized(model, tmp_path / "ck")
    with ts.open(tmp_path / "ck") as ckpt:
        assert ckpt.manifest.version >= (1, 4)  # transposed groups need 1.4
    meta = ts.quantize_model(build("gpt_oss", device="meta"), recipe, columnwise=False)
    ts.load_into(meta, tmp_path / "ck")
    assert_same_model(meta, model)


# --- join_rows: the exact inverse of slicing by rows --------------------------------------------

@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_current", "fp8_block", "fp8_block_1d", "mxfp4"])
@pytest.mark.parametrize("columnwise", [False, True])
def test_join_rows_is_the_inverse_of_slicing(recipe, columnwise):
    q = recipe_quantizer(recipe, rowwise=True, columnwise=columnwise)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(384, 256, generator=g)
    x[:128] *= 1e4        # blocks of very different magnitude on each side of a cut
    x[128:256] *= 1e-4
    x[300, 7] = 0.0
    whole = q.quantize(x.bfloat16())
    cuts = (0, 128, 256, 384)
    parts = [slice_quantized(whole, rows=(a, b)) for a, b in zip(cuts, cuts[1:])]
    shape, bufs = join_rows(q, [(p.logical_shape, p.buffers()) for p in parts])
    assert shape == (384, 256)
    assert set(bufs) == set(whole.buffers())
    assert all(same_bytes(bufs[n], t) for n, t in whole.buffers().items())


def test_join_rows_refuses_what_would_requantize():
    q = recipe_quantizer("fp8_current", columnwise=False)
    a, b = q.quantize(torch.randn(32, 64)), q.quantize(torch.randn(32, 64) * 100)
    with pytest.raises(FormatError, match="tensor-wide scale"):
        join_rows(q, [(a.logical_shape, a.buffers()), (b.logical_shape, b.buffers())])
    q = recipe_quantizer("fp8_block_1d", columnwise=True)  # the columnwise copy's blocks run 128 rows
    a, b = q.quantize(torch.randn(64, 128)), q.quantize(torch.randn(64, 128))
    with pytest.raises(FormatError, match="row blocks of 128"):
        join_rows(q, [(a.logical_shape, a.buffers()), (b.logical_shape, b.buffers())])


# --- transformers' from_pretrained (te_serial.hf) ----------------------------------------------

@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_from_pretrained_quantizes_experts_on_load_and_loads_them_back(arch, recipe, tmp_path):
    hf = pytest.importorskip("te_serial.hf")
    build(arch).save_pretrained(tmp_path / "bf16")
    expected = ts.quantize_model(build(arch), recipe, columnwise=False)
    on_load = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", dtype=torch.bfloat16,
        quantization_config=hf.TeSerialConfig(recipe=recipe, usages=["rowwise"]))
    assert_same_model(on_load, expected)
    on_load.save_pretrained(tmp_path / "te")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "te")
    assert_same_model(again, expected)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, dequantized_copy(expected, arch)(ids).logits)


_ITEMSIZE = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2, "F16": 2}


def _spy_materialized(monkeypatch) -> list[int]:
    """Bytes (as stored) of every checkpoint tensor transformers reads while loading."""
    import transformers.core_model_loading as cml
    seen: list[int] = []
    real = cml._materialize_copy

    def spy(tensor, device=None, dtype=None):
        n = 1
        for d in tensor.get_shape():
            n *= d
        seen.append(n * _ITEMSIZE.get(tensor.get_dtype(), 4))
        return real(tensor, device, dtype)
    monkeypatch.setattr(cml, "_materialize_copy", spy)
    return seen


def _bytes_but_quantized_data(path) -> int:
    """Bytes of a checkpoint's keys other than quantized data (te-serial's ``_rowwise_data`` /
    ``_columnwise_data``; a layout's packed U8 / FP8 ``weight`` and ``weight_packed``; gpt-oss's ``_blocks``)."""
    from safetensors import safe_open
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                data = k.endswith(("_rowwise_data", "_columnwise_data", "_blocks")) or (
                    k.endswith((".weight", ".weight_packed")) and sl.get_dtype() in ("U8", "F8_E4M3", "I8"))
                total += 0 if data else n * _ITEMSIZE.get(sl.get_dtype(), 4)
    return total


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_current"])
@pytest.mark.parametrize("arch", PER_EXPERT)
def test_from_pretrained_of_a_converted_per_expert_checkpoint_equals_load_into(arch, recipe, tmp_path, monkeypatch):
    """``te-serial convert`` of a BF16 MoE directory writes quantized per-expert tensors; from_pretrained
    packs them into the 3-D experts exactly (te-serial reads them itself: transformers' merge would
    concatenate quantized bytes), with load_into's bytes, and transformers reads no expert's data."""
    pytest.importorskip("te_serial.hf")  # registers the te_serial method
    build(arch).save_pretrained(tmp_path / "bf16")
    ts.convert(tmp_path / "bf16", tmp_path / "out", recipe=recipe)
    seen = _spy_materialized(monkeypatch)
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    meta = ts.quantize_model(build(arch, device="meta"), recipe, columnwise=True)
    ts.load_into(meta, tmp_path / "out")
    assert_same_model(got, meta)
    assert isinstance(got.model.layers[-1].get_submodule("mlp.experts").gate_up_proj, GroupedTensor)
    assert sum(seen) <= _bytes_but_quantized_data(tmp_path / "out")   # transformers read no quantized data
    assert any(m.endswith("experts.gate_up_proj") for m in got.config.quantization_config.modules)  # what it holds
    got.save_pretrained(tmp_path / "again")      # a te-serial directory of the model's own names
    assert_same_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again"), meta)


@pytest.mark.parametrize("attention", ["nvfp4", "keep"])
def test_from_pretrained_of_a_per_expert_checkpoint_keeps_each_tensor_as_saved(attention, tmp_path):
    """A converted checkpoint whose experts are MXFP8 and whose attention is NVFP4 or kept in BF16
    loads with each tensor as saved, whatever recipe its config.json names (``mxfp8`` when every
    quantized module has it: the attention is not quantized on the way in)."""
    pytest.importorskip("te_serial.hf")
    build("qwen3_moe").save_pretrained(tmp_path / "bf16")
    ts.convert(tmp_path / "bf16", tmp_path / "out", rules=[("*.experts.*", "mxfp8"), ("*_proj.weight", attention)])
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    plain = build("qwen3_moe", device="meta")
    ts.load_into(plain, tmp_path / "out")
    assert_same_model(got, plain)
    assert got.model.layers[0].mlp.experts.gate_up_proj.quantizer.member.kind == "mxfp8"
    q = got.model.layers[0].self_attn.q_proj.weight
    assert (q.quantizer.kind == "nvfp4") if attention == "nvfp4" else not isinstance(q, QuantizedTensor)


FOREIGN = [("nvfp4", "modelopt_nvfp4"), ("nvfp4", "compressed_tensors_nvfp4"), ("mxfp8", "modelopt_mxfp8"),
           ("mxfp8", "compressed_tensors_mxfp8")]


@pytest.mark.parametrize("recipe,layout", FOREIGN)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_from_pretrained_of_a_foreign_moe_export_with_te_serial_config(arch, recipe, layout, tmp_path, monkeypatch):
    """A MoE in a serving layout (ModelOpt, compressed-tensors, DeepSeek FP8) loads through
    ``from_pretrained(dir, quantization_config=TeSerialConfig(...))`` into quantized 3-D experts with no
    BF16 round trip: TeSerialConfig() keeps the layout's values (the model it was exported from,
    byte for byte); TeSerialConfig(recipe=...) converts them as load_into does."""
    hf = pytest.importorskip("te_serial.hf")
    model = ts.quantize_model(build(arch), recipe, columnwise=False)
    ts.save_quantized(model, tmp_path / "te")
    ts.convert(tmp_path / "te", tmp_path / "out", recipe=layout)
    seen = _spy_materialized(monkeypatch)
    kept = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", quantization_config=hf.TeSerialConfig())
    assert_same_model(kept, model)
    assert sum(seen) <= _bytes_but_quantized_data(tmp_path / "out")
    assert kept.config.quantization_config.quant_method == "te_serial"
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(kept(ids).logits, dequantized_copy(model, arch)(ids).logits)
    other = "nvfp4" if recipe == "mxfp8" else "mxfp8"
    converted = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", quantization_config=hf.TeSerialConfig(recipe=other, usages=["rowwise"]))
    meta = ts.quantize_model(build(arch, device="meta"), other, columnwise=False)
    ts.load_into(meta, tmp_path / "out")
    assert_same_model(converted, meta)
    converted.save_pretrained(tmp_path / "te2")
    assert_same_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "te2"), meta)


def _deepseek_v3_block_fp8(tmp_path):
    """A DeepSeek-V3 of 128-row experts quantized to 128×128 blockwise FP8, exported in DeepSeek's own
    layout (E4M3 weights, ``weight_scale_inv``, one key per expert) to ``tmp_path / "ds"``: (config, model)."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=32, n_group=2, topk_group=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ts.quantize_model(model, "fp8_block", columnwise=False)
    ts.save_quantized(model, tmp_path / "te")
    ts.convert(tmp_path / "te", tmp_path / "ds", recipe="deepseek_fp8")
    return cfg, model


def test_from_pretrained_of_a_deepseek_v3_block_fp8_moe_with_te_serial_config(tmp_path):
    """DeepSeek-V3's own layout (config quant_method 'fp8', which transformers would give its own FP8
    quantizer): TeSerialConfig() reads it into blockwise-FP8 3-D experts, as load_into does."""
    hf = pytest.importorskip("te_serial.hf")
    _, model = _deepseek_v3_block_fp8(tmp_path)
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ds", quantization_config=hf.TeSerialConfig())
    assert_same_model(got, model)
    assert isinstance(got.model.layers[1].mlp.experts.gate_up_proj, GroupedTensor)


def test_from_pretrained_of_a_layout_te_serial_does_not_read_names_it(tmp_path):
    hf = pytest.importorskip("te_serial.hf")
    from te_serial.errors import UnknownLayoutError
    build("qwen3_moe").save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownLayoutError, match="quant_method 'awq' is not a layout te-serial reads"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "d", quantization_config=hf.TeSerialConfig())


# --- exports: the per-expert names engines read ------------------------------------------------

def _export_keys_and_config(out):
    import json
    from safetensors import safe_open
    keys = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            keys.update({k: fh.get_tensor(k) for k in fh.keys()})
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.get("quantization_config", {})
    ignored = qc.get("ignore", qc.get("exclude_modules"))
    if ignored is None and (out / "hf_quant_config.json").exists():
        ignored = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    return keys, ignored


EXPERT_NAMES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


@pytest.mark.parametrize("recipe,layout", [("nvfp4", "modelopt_nvfp4"), ("nvfp4", "compressed_tensors_nvfp4"),
                                           ("mxfp8", "modelopt_mxfp8"), ("mxfp8", "compressed_tensors_mxfp8"),
                                           ("fp8_current", "compressed_tensors_fp8_tensor")])
@pytest.mark.parametrize("arch", PER_EXPERT)
def test_exports_write_each_expert_under_the_engines_names_and_import_back_exactly(arch, recipe, layout, tmp_path):
    model = ts.quantize_model(build(arch), recipe, columnwise=False)
    ts.save_quantized(model, tmp_path / "te")
    amax = None
    if layout.endswith("fp8_tensor"):  # FP8 experts are served only with FP8 activations (static scales here)
        from te_serial.moe import checkpoint_name, plan_split_fused
        arch_name = type(model).__name__
        params = dict(model.named_parameters())
        modules = {n.rsplit(".", 1)[0] for n in plan_split_fused({n: tuple(p.shape) for n, p in params.items()},
                                                                 arch_name)}
        modules |= {checkpoint_name(n.rsplit(".", 1)[0], arch_name) for n, p in params.items()
                    if isinstance(p, QuantizedTensor) and p.dim() == 2}
        amax = dict.fromkeys(modules, 4.0)
    ts.convert(tmp_path / "te", tmp_path / "out", recipe=layout, activation_amax=amax)
    keys, ignored = _export_keys_and_config(tmp_path / "out")
    module, (gate, up, down) = EXPERT_NAMES[arch]
    layer = 1 if arch == "deepseek_v3" else 0   # DeepSeek-V3's first layer is dense
    n = CONFIGS[arch]().to_dict().get("num_experts") or CONFIGS[arch]().to_dict().get("num_local_experts") \
        or CONFIGS[arch]().n_routed_experts
    for i in range(n):
        for proj in (gate, up, down):
            assert any(k.startswith(f"model.layers.{layer}.{module}.experts.{i}.{proj}.") for k in keys), (i, proj)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)  # no 3-D names left
    routers = sorted(f"model.layers.{i}.{module}.gate" for i in range(2) if arch != "deepseek_v3" or i == 1)
    assert [m for m in ignored if m.endswith(".gate")] == routers  # the high-precision modules, by their names
    assert not any(".experts." in m for m in ignored)
    if recipe == "nvfp4":  # gate and up of each expert carry one global scale, as vLLM serves them
        suffix = "weight_scale_2" if layout.startswith("modelopt") else "weight_global_scale"
        for i in range(n):
            pre = f"model.layers.{layer}.{module}.experts.{i}."
            assert torch.equal(keys[f"{pre}{gate}.{suffix}"], keys[f"{pre}{up}.{suffix}"])
    meta = ts.quantize_model(build(arch, device="meta"), recipe, columnwise=False)
    ts.load_into(meta, tmp_path / "out")   # the export, read back into the 3-D experts
    assert_same_model(meta, model)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_an_export_reads_a_stacks_experts_together_with_the_same_bytes(recipe, tmp_path, monkeypatch):
    """A serving export writes each expert on its own, but reads a stack's experts a batch at a time
    (one ``members=`` range per stack and pass, not one read per expert), and each piece it gets is
    byte-identical to that expert read alone; a corrupted stack still fails the export before
    anything is committed."""
    from te_serial.checkpoint.reader import Checkpoint
    from te_serial.conversion.core import _batches, plan_conversion
    from te_serial.conversion.sources import open_source, split_experts
    from te_serial.errors import CheckpointError
    model = ts.quantize_model(build("qwen3_moe"), recipe, columnwise=False)
    ts.save_quantized(model, tmp_path / "te")
    with open_source(tmp_path / "te") as inner:
        source = split_experts(inner)
        _, _, plans = plan_conversion(source, recipe="modelopt_" + recipe)
        batches = [b for b in _batches(source, plans) if len(b) > 1]
        stacks = {n for n, st in inner.tensors.items() if ".experts." in n}
        assert {source.piece_of(b[0].name) for b in batches} == stacks   # every stack, batched
        for batch in batches:
            names = [p.name for p in batch]
            for name, got in zip(names, source.load_pieces(names)):
                assert_same_tensor(got, source.load(name), name)
    reads = []
    real, real_stream = Checkpoint.get, Checkpoint.stream
    monkeypatch.setattr(Checkpoint, "get", lambda self, name, *a, **kw: reads.append((name, kw.get("member"),
                                                                                     kw.get("members")))
                        or real(self, name, *a, **kw))
    monkeypatch.setattr(Checkpoint, "stream", lambda self, name, *a, **kw: reads.append((name, None,
                                                                                        kw.get("members")))
                        or real_stream(self, name, *a, **kw))
    ts.convert(tmp_path / "te", tmp_path / "out", recipe="modelopt_" + recipe)
    assert not [r for r in reads if r[1] is not None]    # no expert read on its own
    assert not [r for r in reads if r[0] in stacks and r[2] is None]   # nor a stack whole
    # each stack once (streamed: a byte relayout); NVFP4's gate_up once more, before: its gate and up
    # take one global scale
    want = {s: 2 if recipe == "nvfp4" and s.endswith("gate_up_proj") else 1 for s in stacks}
    assert collections.Counter(r[0] for r in reads if r[2] is not None) == want
    monkeypatch.setattr(Checkpoint, "get", real)
    monkeypatch.setattr(Checkpoint, "stream", real_stream)
    with ts.open(tmp_path / "te") as ck:
        _, file, key = ck.manifest.locations(sorted(stacks)[0])[0][:3]
    shard = tmp_path / "te" / file
    data = bytearray(shard.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:header])
    data[header + meta[key]["data_offsets"][0] + 3] ^= 0x40   # one byte of the stack's first buffer
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        ts.convert(tmp_path / "te", tmp_path / "bad", recipe="modelopt_" + recipe)
    assert not (tmp_path / "bad" / "config.json").exists() and not list((tmp_path / "bad").glob("*.safetensors"))


def _same_checkpoint(a: Path, b: Path) -> None:
    """Two te-serial checkpoints with the same tensors, prototypes, buffer bytes and checksums."""
    with ts.open(a) as x, ts.open(b) as y:
        assert list(x.keys()) == list(y.keys())
        for name in x.keys():
            assert x.manifest.tensors[name].proto == y.manifest.tensors[name].proto, name
            assert [e.checksum for e in x.manifest.tensors[name].buffers.values()] == \
                [e.checksum for e in y.manifest.tensors[name].buffers.values()], name
            assert_same_tensor(y.get(name), x.get(name), name)


@pytest.mark.parametrize("source", ["gpt_oss", "te_serial"])
def test_a_stack_larger_than_an_item_converts_a_range_of_experts_at_a_time(source, tmp_path, monkeypatch):
    """A te-serial output's expert stack larger than a pipeline item is read, converted and written a
    range of experts at a time (never read whole), and gives the checkpoint, checksums and report the
    whole stack gives; a corrupted range fails the conversion before anything is committed."""
    import _mxfp4_data as D
    from te_serial.conversion import core
    from te_serial.conversion.sources import Source
    from te_serial.errors import CheckpointError
    if source == "gpt_oss":
        src, _ = D.gpt_oss_checkpoint(tmp_path / "src")
    else:
        src = tmp_path / "src"
        ts.save_quantized(ts.quantize_model(build("qwen3_moe"), "mxfp4", columnwise=False), src)
    whole = ts.convert(src, tmp_path / "whole", recipe="mxfp8")
    stacks = {t.name for t in whole.tensors if t.target.startswith("grouped")}
    assert len(stacks) == 4 and all(t.label == "lossless" for t in whole.tensors if t.name in stacks)
    reads = []
    for cls in {Source, *Source.__subclasses__()}:   # every source's member reads, recorded
        if "stream_members" in vars(cls):
            orig = vars(cls)["stream_members"]
            monkeypatch.setattr(cls, "stream_members", lambda self, name, a, b, _o=orig: reads.append((name, a, b))
                                or _o(self, name, a, b))
    monkeypatch.setattr(core, "PIECE_BATCH_BYTES", 1)   # every stack: one expert per item
    parts = ts.convert(src, tmp_path / "parts", recipe="mxfp8")
    _same_checkpoint(tmp_path / "whole", tmp_path / "parts")
    assert [t.to_dict() for t in parts.tensors] == [t.to_dict() for t in whole.tensors]
    n = {t.name: t.shape[0] for t in whole.tensors if t.name in stacks}
    assert sorted(reads) == sorted((name, i, i + 1) for name in stacks for i in range(n[name]))
    if source == "gpt_oss":
        return
    with ts.open(src) as ck:
        stack = sorted(stacks)[-1]
        _, file, key = ck.manifest.locations(stack)[0][:3]
    shard = src / file
    data = bytearray(shard.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:header])[key]["data_offsets"]
    data[header + end - 3] ^= 0x40   # a byte of the stack's last expert
    shard.write_bytes(bytes(data))
    before = sorted(p.name for p in (tmp_path / "whole").iterdir())
    with pytest.raises(CheckpointError, match="checksum"):
        ts.convert(src, tmp_path / "whole", recipe="mxfp8", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == before   # the previous conversion stays
    _same_checkpoint(tmp_path / "whole", tmp_path / "parts")


def _export_files(out):
    from safetensors import safe_open
    keys = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            keys.update({k: fh.get_tensor(k) for k in fh.keys()})
    others = {f.name: f.read_bytes() for f in out.iterdir() if f.suffix == ".json" and f.name != "model.safetensors.index.json"}
    return keys, others


@pytest.mark.parametrize("recipe, layout, joined", [
    ("mxfp8", "modelopt_mxfp8", True), ("mxfp8", "compressed_tensors_mxfp8", True), ("mxfp8", "sglang_mxfp8", True),
    ("fp8_block", "modelopt_fp8_pb_wo", True), ("fp8_block", "deepseek_fp8", True),
    ("mxfp4", "compressed_tensors_mxfp4", True), ("nvfp4", "modelopt_nvfp4", False),
    ("nvfp4", "compressed_tensors_nvfp4", False)])
def test_a_stacks_experts_exported_joined_are_what_one_by_one_writes(recipe, layout, joined, tmp_path, monkeypatch):
    """An export writes a stack's experts as one tensor cut by rows, each joined buffer with one write,
    where its layout's scheme is row by row (``row_local``): the files, config, sidecar and report are
    those of the export expert by expert, byte for byte. Two-level schemes (a tensor scale per expert)
    go expert by expert. Rows of 128 (128 × 128 blocks) and padded scale grids (MXFP8 of 64 rows) both."""
    import te_serial.conversion.core as core
    from te_serial.checkpoint.shards import ShardSet
    cfg = qwen3_moe_config()
    if recipe == "fp8_block":   # experts' gate and up on 128-row blocks
        cfg.hidden_size, cfg.moe_intermediate_size, cfg.intermediate_size = 128, 128, 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:
                for i in range(p.shape[0]):
                    p[i].mul_(10.0 ** ((i % 5) - 2))
                p[1].zero_()
    ts.save_quantized(ts.quantize_model(model, recipe, columnwise=False), tmp_path / "te")
    taken, runs = [], []
    real_joined, real_run = core._export_joined, ShardSet.write_run
    monkeypatch.setattr(core, "_export_joined", lambda *a: taken.append(real_joined(*a)) or taken[-1])
    monkeypatch.setattr(ShardSet, "write_run", lambda self, keys, t: runs.append(real_run(self, keys, t)) or runs[-1])
    rep = ts.convert(tmp_path / "te", tmp_path / "joined", recipe=layout)
    assert bool(taken) == joined and all(t is not None for t in taken)
    assert runs.count(True) == (2 * len(taken) if joined else 0)   # data and scales: one write each per stack
    monkeypatch.setattr(core, "_export_joined", lambda *a: None)   # read joined, then cut back: one by one
    cut = ts.convert(tmp_path / "te", tmp_path / "cut", recipe=layout)
    monkeypatch.setattr(core, "_joinable", lambda *a: False)          # read and written one by one
    alone = ts.convert(tmp_path / "te", tmp_path / "alone", recipe=layout)
    want_keys, want_others = _export_files(tmp_path / "alone")
    want = json.loads(alone.to_json())
    for out, got in (("joined", rep), ("cut", cut)):
        keys, others = _export_files(tmp_path / out)
        assert keys.keys() == want_keys.keys() and others == want_others, out
        for k, t in want_keys.items():
            assert keys[k].dtype == t.dtype and keys[k].shape == t.shape and torch.equal(
                keys[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (out, k)
        doc = json.loads(got.to_json())
        for d in (doc, want):   # where and how long: the rest is every tensor's report, the notes, the totals
            d.pop("dst", None), d.pop("seconds", None)
            d["files"] = [Path(f).name for f in d["files"]]
        assert doc == want, out
    assert any(".experts.3.up_proj" in t.name for t in rep.tensors)


def test_an_export_of_bf16_3d_experts_reads_each_stack_by_rows_and_quantizes_each_expert(tmp_path, monkeypatch):
    """A te-serial checkpoint holding a model's 3-D experts in BF16, exported to a serving layout: each
    stack is read by expert ranges (``members=``, never whole per batch), and the experts written
    quantized load back equal to ``quantize_model`` of the same model."""
    from te_serial.checkpoint.reader import Checkpoint
    model = build("qwen3_moe")
    ts.save_quantized(model, tmp_path / "te")
    reads = []
    real = Checkpoint.get
    real_stream = Checkpoint.stream
    monkeypatch.setattr(Checkpoint, "get", lambda self, name, *a, **kw: reads.append((name, kw.get("members")))
                        or real(self, name, *a, **kw))
    monkeypatch.setattr(Checkpoint, "stream", lambda self, name, *a, **kw: reads.append((name, kw.get("members")))
                        or real_stream(self, name, *a, **kw))
    ts.convert(tmp_path / "te", tmp_path / "out", recipe="modelopt_mxfp8")
    stacks = {n for n, p in model.named_parameters() if p.dim() == 3}
    assert {n for n, rows in reads if rows is not None} == stacks
    assert not [n for n, rows in reads if n in stacks and rows is None]   # never read whole
    meta = ts.quantize_model(build("qwen3_moe", device="meta"), "mxfp8", columnwise=False)
    ts.load_into(meta, tmp_path / "out")
    assert_same_model(meta, ts.quantize_model(model, "mxfp8", columnwise=False))


def test_export_tensors_of_a_moe_model_names_its_experts():
    model = ts.quantize_model(build("mixtral"), "mxfp8", columnwise=False)
    names = [n for n, _ in ts.serving.export_tensors(model, "modelopt_mxfp8")]
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)


def test_an_export_no_engine_serves_for_experts_is_refused(tmp_path):
    """compressed-tensors FP8 weight-only (W8A16): vLLM has no MoE method for it; the export says so
    instead of writing a checkpoint that loads nowhere."""
    model = ts.quantize_model(build("qwen3_moe"), "fp8_current", columnwise=False)
    ts.save_quantized(model, tmp_path / "te")
    with pytest.raises(ConversionError, match=r"W8A16.*MoE experts.*experts\.0\.gate_proj.*no MoE method"):
        ts.convert(tmp_path / "te", tmp_path / "out", recipe="compressed_tensors_fp8")
    assert not (tmp_path / "out").exists()
    build("qwen3_moe").save_pretrained(tmp_path / "bf16")   # the experts kept out by a rule: written
    ts.convert(tmp_path / "bf16", tmp_path / "kept",
               rules=[("*.experts.*", "keep"), ("*_proj.weight", "compressed_tensors_fp8")])
    keys, ignored = _export_keys_and_config(tmp_path / "kept")
    assert keys["model.layers.0.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert keys["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_gpt_oss_experts_convert_to_bf16_and_are_refused_by_serving_layouts_naming_them(tmp_path):
    from safetensors.torch import load_file
    model = ts.quantize_model(build("gpt_oss"), "mxfp8", columnwise=False)
    ts.save_quantized(model, tmp_path / "te")
    with pytest.raises(ConversionError,
                       match=r"one 3-D tensor.*not written to this serving layout; convert to gpt_oss_mxfp4.*gate_up_proj"):
        ts.convert(tmp_path / "te", tmp_path / "served", recipe="modelopt_mxfp8")
    ts.convert(tmp_path / "te", tmp_path / "bf16", recipe="bf16")   # 3-D names kept, as gpt-oss checkpoints do
    state = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for name, p in expert_stacks(model).items():
        assert torch.equal(state[name], p.dequantize())


# --- calibration: per-expert activation amax, for static exports --------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_activation_amax_records_each_experts_input_under_its_export_name(arch, tmp_path):
    from te_serial.conversion import ActivationAmax
    model = ts.quantize_model(build(arch), "nvfp4", columnwise=False)
    routed: dict[str, list] = {}  # an independent record of what each experts module was given

    def spy(name):
        def hook(module, args):
            routed.setdefault(name, []).append((args[0].detach().float(), args[1].detach()))
        return hook
    experts = {n: m for n, m in model.named_modules() if n.endswith(".experts")}
    hooks = [m.register_forward_pre_hook(spy(n)) for n, m in experts.items()]
    ids = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(4))
    with ActivationAmax(model) as cal, torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    module, (gate, up, down) = EXPERT_NAMES[arch]
    for name, calls in routed.items():
        base = name.replace(".mlp.", f".{module}.")
        for e in range(experts[name].num_experts):
            seen = torch.cat([x.reshape(-1, x.shape[-1])[(i.reshape(x.numel() // x.shape[-1], -1) == e).any(-1)]
                              for x, i in calls])
            want = float(seen.abs().amax()) if seen.numel() else 0.0
            got = [cal.amax.get(f"{base}.{e}.{p}") for p in (gate, up, down)]
            if want == 0.0:  # never routed here, or only zeros: nothing recorded (exports fill it)
                assert got[:2] == [None, None]
                continue
            assert got[0] == got[1] == want, (name, e)
            if e != 1:  # expert 1 is all zeros: its intermediate is zero
                assert got[2] is not None and got[2] > 0
    ts.save_quantized(model, tmp_path / "te")
    rep = ts.convert(tmp_path / "te", tmp_path / "out", recipe="modelopt_nvfp4", activation_amax=cal.amax)
    assert any("no calibrated input amax" in n for n in rep.notes)  # the all-zero expert got its layer's max
    keys, _ = _export_keys_and_config(tmp_path / "out")
    layer = f"model.layers.0.{module}.experts"
    for e in range(experts["model.layers.0.mlp.experts"].num_experts):
        for p in (gate, up, down):
            assert f"{layer}.{e}.{p}.input_scale" in keys, (e, p)
    downs = [keys[f"{layer}.{e}.{down}.input_scale"] for e in range(4)]
    assert torch.equal(keys[f"{layer}.1.{down}.input_scale"], max(downs, key=float))  # the layer's max amax


def test_a_deepseek_v3_block_fp8_checkpoint_loads_into_the_3d_experts_without_a_bf16_copy(tmp_path):
    """DeepSeek-V3's own layout (E4M3 weights + weight_scale_inv per 128×128 block, one key per
    expert): load_into reads it into the model's 3-D experts as blockwise FP8, exactly (the gate's
    128 rows end on a block), no BF16 round trip."""
    cfg, model = _deepseek_v3_block_fp8(tmp_path)
    keys, _ = _export_keys_and_config(tmp_path / "ds")
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv" in keys
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ts.quantize_model(meta, "fp8_block", columnwise=False)
    rep = ts.load_into(meta, tmp_path / "ds").te_serial_report
    assert_same_model(meta, model)
    row = next(t for t in rep.tensors if t.name == "model.layers.1.mlp.experts.gate_up_proj")
    assert row.method in ("copy", "relayout", "keep") and row.label == "lossless", (row.method, row.label)
