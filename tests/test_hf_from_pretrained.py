"""``from_pretrained`` of te-serial checkpoints and quantize on load, through ``te_serial.hf``.

Real transformers classes (Llama, Qwen2, Qwen2-MoE) from small configs with random weights, no
network (hub repositories are fake huggingface_hub caches read offline); every Llama/Qwen2 dim a
multiple of 128, so every recipe applies (Qwen2-MoE's [1, hidden] shared-expert gate is refused by
some). The references are te-serial's own paths: ``load_into`` of the same checkpoint (same
quantizers, same bytes, bit-equal logits) and ``quantize_model`` of the same BF16 model (same bytes).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import te_serial as ts
from te_serial.formats.grouped import GroupedQuantizer
from helpers import seeded_hf_model
from te_serial import errors as tse
from te_serial import formats as tsf
from te_serial.recipes import RECIPES, recipe_quantizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import transformers.core_model_loading as cml  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen2MoeConfig  # noqa: E402
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING  # noqa: E402

import te_serial.hf as tshf  # noqa: E402  (registers the te_serial method)
from te_serial.hf import TeSerialConfig  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

SMALL = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


#: Qwen2-MoE: 4 experts (transformers 5 holds them as 3-D parameters), a shared expert and its [1, 128] gate
MOE = dict(vocab_size=256, hidden_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=256,
           num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=64)


def _config(arch="llama", tied=True, **kw):
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**{**MOE, **kw}, tie_word_embeddings=tied)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return cls(**{**SMALL, **kw}, tie_word_embeddings=tied)


_bf16_model = seeded_hf_model


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    out = {}
    for arch, tied in (("llama", True), ("qwen2", False), ("qwen2_moe", False)):
        path = root / arch
        _bf16_model(_config(arch, tied)).save_pretrained(path)
        out[arch] = path
    return out


def _te_dir(path: Path, arch, recipe, columnwise, tied=None):
    """quantize_model + save_quantized of the seeded BF16 model: a te-serial checkpoint directory."""
    model = _bf16_model(_config(arch, arch == "llama" if tied is None else tied))
    ts.quantize_model(model, recipe, columnwise=columnwise)
    ts.save_quantized(model, path, max_shard_size="5GB" if arch == "llama" else "200KB")  # the others: sharded
    return path


def _refuses(recipe, shape, columnwise=False):
    """Whether the recipe's shape rule refuses a weight of this shape (quantize_model then warns and keeps it)."""
    try:
        recipe_quantizer(recipe, rowwise=True, columnwise=columnwise).check_shape(shape)
    except tse.ShapeError:
        return True
    return False


def _left_unquantized(caught):
    """The weight names quantize_model's (or quantize on load's) shape warnings name."""
    return sorted(str(w.message).split()[1] for w in caught if "left unquantized" in str(w.message))


def _experts_refused(recipe, columnwise=False):
    """Whether the recipe cannot quantize the experts one by one (delayed scaling: TE does not group it)."""
    try:
        GroupedQuantizer(member=recipe_quantizer(recipe, rowwise=True, columnwise=columnwise),
                         member_shapes=[(2 * MOE["moe_intermediate_size"], MOE["hidden_size"])])
    except (tse.FormatError, tse.ShapeError):
        return True
    return False


def _moe_quantized(recipe, columnwise=False):
    """The Qwen2-MoE weights te-serial quantizes: attention and shared-expert linears and the experts'
    3-D parameters (each expert on its own), where the recipe groups; never the router (mlp.gate)
    nor the shared-expert gate (te_serial.precision)."""
    mods = [f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    mods += [f"mlp.shared_expert.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    if not _experts_refused(recipe, columnwise):
        mods += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return sorted(f"model.layers.{i}.{m}" for i in range(MOE["num_hidden_layers"]) for m in mods)


def _meta_model(cfg, dtype=torch.bfloat16):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _ids(seed=0, n=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (2, n), generator=g)


def _assert_same_model(got, want):
    """Same names, classes, quantizers, nominal dtypes, requires_grad and bytes; same buffers."""
    a, b = got.state_dict(keep_vars=True), want.state_dict(keep_vars=True)
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        assert type(x) is type(y) and x.dtype == y.dtype and x.requires_grad == y.requires_grad, name
        if isinstance(x, tsf.QuantizedTensor):
            assert x.quantizer == y.quantizer and x.shape == y.shape, name
            bx, by = x.buffers(), y.buffers()
            assert list(bx) == list(by), name
            for k in bx:
                assert bx[k].dtype == by[k].dtype and torch.equal(bx[k].view(torch.uint8), by[k].view(torch.uint8)), \
                    (name, k)
        else:
            assert x.device.type == "cpu" and torch.equal(x, y), name
    bufs_a, bufs_b = dict(got.named_buffers()), dict(want.named_buffers())
    assert list(bufs_a) == list(bufs_b)
    for name in bufs_a:  # rotary inv_freq: initialized as transformers does
        assert bufs_a[name].dtype == bufs_b[name].dtype and torch.equal(bufs_a[name], bufs_b[name]), name


def _assert_same_logits(got, want):
    ids = _ids()
    with torch.no_grad():
        a, b = got(ids).logits, want(ids).logits
    assert a.dtype == b.dtype and torch.equal(a, b)


def _quantized(model):
    return sorted(n for n, p in model.named_parameters() if isinstance(p, tsf.QuantizedTensor))


@pytest.fixture
def materialized(monkeypatch):
    """Elements of every checkpoint slice transformers materializes while loading."""
    seen: list[int] = []
    real = cml._materialize_copy

    def spy(tensor, device=None, dtype=None):
        if hasattr(tensor, "get_shape"):
            n = 1
            for d in tensor.get_shape():
                n *= d
            seen.append(n)
        return real(tensor, device, dtype)

    monkeypatch.setattr(cml, "_materialize_copy", spy)
    return seen


def _numel_split(path):
    """(elements of plain tensors and small buffers, elements of data buffers) a checkpoint stores."""
    with ts.open(path) as ck:
        small = data = 0
        for rows in ck.manifest.buffers_by_file().values():
            for tensor, buffer, _, shape, _ in rows:
                q = ck.protos[tensor].quantizer
                n = 1
                for d in shape:
                    n *= d
                if q is not None and buffer in q.data_buffers():
                    data += n
                else:
                    small += n
    return small, data


# --- a te-serial checkpoint, pre-quantized ----------------------------------------------------------

CASES = [(r, "llama", False) for r in RECIPES] + [(r, "qwen2", True) for r in ("mxfp8", "fp8_current", "fp8_block",
                                                                                "nvfp4_2d")]


@pytest.mark.parametrize("recipe, arch, columnwise", CASES)
def test_from_pretrained_of_a_te_serial_checkpoint_equals_load_into(tmp_path, materialized, recipe, arch, columnwise):
    path = _te_dir(tmp_path / "ck", arch, recipe, columnwise)
    assert (path / tshf.HF_INDEX_NAME).is_file() and not (path / "model.safetensors.index.json").exists()
    with ts.open(path) as ck:
        assert (len(ck.manifest.files) > 1) == (arch == "qwen2")
    saved = json.loads((path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "te_serial" and saved["recipe"] == recipe
    assert saved["usages"] == (["rowwise", "columnwise"] if columnwise and recipe != "nvfp4_row_scaled" else ["rowwise"])
    assert TeSerialConfig.from_dict(saved).to_dict() == saved  # config.json's quantization_config round-trips

    got = AutoModelForCausalLM.from_pretrained(path)
    cfg = _config(arch, arch == "llama")
    want = ts.load_into(_meta_model(cfg), path)
    _assert_same_model(got, want)
    assert len(_quantized(got)) == 14 and not any("lm_head" in n or "embed" in n for n in _quantized(got))
    _assert_same_logits(got, want)
    if arch == "llama":
        assert got.lm_head.weight is got.model.embed_tokens.weight  # tied, by transformers
    assert isinstance(got.config.quantization_config, TeSerialConfig) and got.is_quantized
    assert got.config.quantization_config.to_dict() == saved
    assert not hasattr(got.config, "transformers_weights")  # te_serial.hf's pointer is not left in the config
    small, data = _numel_split(path)
    assert sum(materialized) == small and data > small  # transformers never read a data buffer


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_from_pretrained_of_a_te_serial_moe_checkpoint_equals_load_into(tmp_path, materialized, recipe):
    """Qwen2-MoE: the attention and shared-expert linears and the experts' 3-D parameters quantized
    (grouped, per-expert scales), the router and shared-expert gate in high precision, as
    quantize_model leaves them. The checkpoint holds the model's own names (3-D
    ``experts.gate_up_proj``), so transformers' MoE conversion mapping (per-expert keys merged into
    the 3-D parameters) finds nothing to merge and no quantized tensor to rewrite."""
    refused = _experts_refused(recipe, columnwise=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = _te_dir(tmp_path / "ck", "qwen2_moe", recipe, True)
    assert _left_unquantized(caught) == (sorted(f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                                for p in ("down_proj", "gate_up_proj")) if refused else [])
    with ts.open(path) as ck:
        assert len(ck.manifest.files) > 1 and "model.layers.1.mlp.experts.gate_up_proj" in ck
        assert not any(".experts.0." in n for n in ck)
    got = AutoModelForCausalLM.from_pretrained(path)
    want = ts.load_into(_meta_model(_config("qwen2_moe", False)), path)
    _assert_same_model(got, want)
    _assert_same_logits(got, want)
    assert _quantized(got) == _moe_quantized(recipe, columnwise=True)
    experts = got.model.layers[1].mlp.experts
    for p in (experts.gate_up_proj, experts.down_proj):
        assert p.dim() == 3 and p.dtype == torch.bfloat16
        assert isinstance(p, tsf.GroupedTensor) is not refused
    assert got.config.quantization_config.recipe == recipe
    small, _ = _numel_split(path)
    assert sum(materialized) == small  # transformers never read a data buffer


def _per_expert_linears_checkpoint(path, recipe, **config):
    """A checkpoint of quantized per-expert linears (a Qwen2-MoE with one nn.Linear per expert, as
    transformers 4 built it), and the model it holds."""
    model = _bf16_model(_config("qwen2_moe", False, **config))
    inter = model.config.moe_intermediate_size
    for layer in model.model.layers:
        packed = layer.mlp.experts
        per_expert = torch.nn.ModuleList()
        for e in range(MOE["num_experts"]):
            expert = torch.nn.Module()
            for name, w in (("gate_proj", packed.gate_up_proj[e, :inter]), ("up_proj", packed.gate_up_proj[e, inter:]),
                            ("down_proj", packed.down_proj[e])):
                linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
                linear.weight = torch.nn.Parameter(w.detach().clone())
                setattr(expert, name, linear)
            per_expert.append(expert)
        layer.mlp.experts = per_expert
    ts.quantize_model(model, recipe, columnwise=False)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in _quantized(model)
    ts.save_quantized(model, path)
    return model


def test_quantized_per_expert_linears_load_into_the_3d_experts_as_load_into_gives_them(tmp_path, materialized):
    """transformers 5 merges per-expert keys into 3-D parameters; te-serial reads such quantized
    tensors itself (joined exactly into grouped tensors), so the model holds load_into's bytes and
    transformers never reads an expert's data."""
    _per_expert_linears_checkpoint(tmp_path / "ck", "fp8_block")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(_config("qwen2_moe", False), dtype=torch.bfloat16)
    ts.load_into(ts.quantize_model(meta, "fp8_block", columnwise=False), tmp_path / "ck")
    assert isinstance(got.model.layers[0].mlp.experts.gate_up_proj, tsf.GroupedTensor)
    want = dict(meta.named_parameters())
    for name, p in got.named_parameters():
        assert type(p) is type(want[name]) and torch.equal(p.dequantize() if isinstance(p, tsf.QuantizedTensor) else p,
                                                          want[name].dequantize()
                                                          if isinstance(want[name], tsf.QuantizedTensor) else want[name])
    small, _ = _numel_split(tmp_path / "ck")
    assert sum(materialized) <= small  # transformers read no data buffer (one small trigger per tensor at most)


def test_quantized_per_expert_linears_whose_blocks_would_mix_gate_and_up_are_refused(tmp_path):
    """64 gate rows in 128×128 blocks: a block would hold gate and up rows, so no exact join exists;
    te-serial's error names the tensor and the block rule, before any weight is read."""
    _per_expert_linears_checkpoint(tmp_path / "ck", "fp8_block", moe_intermediate_size=64)
    with pytest.raises(tse.ConversionError, match=r"experts\.gate_up_proj exactly.*128"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "ck")


def test_dtype_and_device_maps(tmp_path):
    path = _te_dir(tmp_path / "ck", "qwen2", "nvfp4", True)
    cfg = _config("qwen2", False)
    want = ts.load_into(_meta_model(cfg), path)
    want32 = ts.load_into(_meta_model(cfg, torch.float32), path)
    got32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu")
    w = got32.model.layers[0].mlp.up_proj.weight
    assert isinstance(w, tsf.NVFP4Tensor) and w.dtype == torch.float32  # the model's dtype, nominally
    _assert_same_model(got32, want32)
    _assert_same_logits(got32, want32)
    for device_map in ("auto", {"": "cpu"}):
        got = AutoModelForCausalLM.from_pretrained(path, device_map=device_map)
        _assert_same_model(got, want)
        _assert_same_logits(got, want)


def test_missing_and_unexpected_weights_are_reported_as_transformers_reports_them(tmp_path):
    """A model with fewer layers than the checkpoint: the extra layers' weights are unexpected keys,
    named as the model's parameters (not as te-serial's buffers); with more layers, the missing
    ones are missing keys, initialized by transformers in high precision; the rest loads as saved."""
    path = _te_dir(tmp_path / "ck", "llama", "mxfp8", False)
    want = ts.load_into(_meta_model(_config("llama", True)), path)
    fewer, info = AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=1, output_loading_info=True)
    assert not info["missing_keys"] and not info["error_msgs"]
    assert sorted(info["unexpected_keys"]) == sorted(n for n in want.state_dict() if n.startswith("model.layers.1."))
    more, info = AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=3, output_loading_info=True)
    assert not info["unexpected_keys"]
    assert sorted(info["missing_keys"]) == sorted(n.replace("layers.1.", "layers.2.") for n in want.state_dict()
                                                  if n.startswith("model.layers.1."))
    assert [n for n in _quantized(more) if ".layers.2." in n] == []
    assert _quantized(more) == _quantized(want) and _quantized(fewer) == [n for n in _quantized(want) if ".layers.0." in n]
    for name, p in more.state_dict(keep_vars=True).items():
        if ".layers.2." not in name:
            x = want.state_dict(keep_vars=True)[name]
            assert type(p) is type(x) and all(torch.equal(a, b) for a, b in zip(
                (p.buffers().values() if hasattr(p, "quantizer") else [p]),
                (x.buffers().values() if hasattr(x, "quantizer") else [x]))), name


def test_a_loaded_model_trains_adapters_and_saves_through_save_quantized(tmp_path):
    path = _te_dir(tmp_path / "ck", "llama", "mxfp8", True)
    got = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(tse.UnsupportedOperationError, match="pickle"):
        got.save_pretrained(tmp_path / "nope", safe_serialization=False)
    ts.save_quantized(got, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"] == \
        json.loads((path / "config.json").read_text())["quantization_config"]
    _assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "again"), got)
    for p in got.parameters():  # the quantized base frozen, as adapter training has it
        p.requires_grad_(not isinstance(p, tsf.QuantizedTensor))
    ids = _ids()
    got(ids, labels=ids).loss.backward()
    assert got.model.norm.weight.grad is not None and torch.isfinite(got.model.norm.weight.grad).all()
    with torch.no_grad():
        before = got(ids).logits
    got.dequantize()  # transformers' own API: back to a plain BF16 model, which save_pretrained writes
    assert not _quantized(got) and not got.is_quantized
    with torch.no_grad():
        assert torch.equal(got(ids).logits, before)
    got.save_pretrained(tmp_path / "plain")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_a_plain_model_saved_by_te_serial_gets_no_quantization_config(tmp_path):
    ts.save_quantized(_bf16_model(_config()), tmp_path / "plain")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert not (tmp_path / "plain" / tshf.HF_INDEX_NAME).exists()


# --- quantize on load -------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe, arch, device_map", [
    ("mxfp8", "llama", "auto"), ("fp8_block", "qwen2", None), ("nvfp4", "qwen2", None),
    ("fp8_current", "llama", "cpu"), ("nvfp4_2d", "llama", None)])
def test_quantize_on_load_equals_quantize_model(bf16_dirs, tmp_path, recipe, arch, device_map):
    """Each weight quantized as transformers hands it over, with quantize_model's bytes; for a
    tensor-wide scale (nvfp4, fp8_current) that includes the fused groups' shared amax."""
    got = AutoModelForCausalLM.from_pretrained(bf16_dirs[arch], device_map=device_map,
                                               quantization_config=TeSerialConfig(recipe=recipe, usages=["rowwise"]))
    want = AutoModelForCausalLM.from_pretrained(bf16_dirs[arch])
    ts.quantize_model(want, recipe, columnwise=False)
    _assert_same_model(got, want)
    _assert_same_logits(got, want)
    assert len(_quantized(got)) == 14
    shared = {"nvfp4": "_amax_rowwise", "fp8_current": "_scale_inv"}.get(recipe)
    if shared:  # q/k/v and gate/up: one tensor scale each
        for group in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            parent = getattr(got.model.layers[1], group[0])
            scales = [getattr(parent, m).weight.buffers()[shared] for m in group[1]]
            assert all(torch.equal(x, scales[0]) for x in scales), group
    qc = got.config.quantization_config
    assert qc.recipe == recipe and qc.usages == ["rowwise"] and len(qc.modules) == 14
    ts.save_quantized(got, tmp_path / "ck")  # and back through a te-serial checkpoint
    _assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "ck"), got)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_quantize_on_load_of_a_moe_equals_quantize_model(bf16_dirs, tmp_path, recipe):
    """Qwen2-MoE as transformers' save_pretrained writes it (one key per expert): the conversion
    mapping merges the experts into their 3-D parameters, which stay in high precision; the other
    weights get quantize_model's bytes (nvfp4: the shared expert's gate/up share one amax), and a
    weight the recipe's shape rule refuses stays in high precision with quantize_model's warning."""
    from safetensors import safe_open
    with safe_open(bf16_dirs["qwen2_moe"] / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in keys  # one key per expert: the mapping merges them
    assert "model.layers.0.mlp.experts.down_proj" not in keys
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = AutoModelForCausalLM.from_pretrained(bf16_dirs["qwen2_moe"], quantization_config=TeSerialConfig(
            recipe=recipe, usages=["rowwise"]))
    want = AutoModelForCausalLM.from_pretrained(bf16_dirs["qwen2_moe"])
    with warnings.catch_warnings(record=True) as caught_want:
        warnings.simplefilter("always")
        ts.quantize_model(want, recipe, columnwise=False)
    assert _left_unquantized(caught) == _left_unquantized(caught_want) == []
    _assert_same_model(got, want)
    _assert_same_logits(got, want)
    assert _quantized(got) == _moe_quantized(recipe)
    for layer in got.model.layers:  # the merged experts, quantized one expert at a time
        for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            assert isinstance(p, tsf.GroupedTensor) and p.quantizer.num_tensors == MOE["num_experts"]
    if recipe == "nvfp4":  # one tensor scale for the shared expert's gate/up group
        gate, up = (getattr(got.model.layers[1].mlp.shared_expert, m).weight for m in ("gate_proj", "up_proj"))
        assert torch.equal(gate.buffers()["_amax_rowwise"], up.buffers()["_amax_rowwise"])
    ts.save_quantized(got, tmp_path / "ck", max_shard_size="200KB")  # and back through a te-serial checkpoint
    _assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "ck"), got)


def test_fused_off_quantizes_each_member_on_its_own(bf16_dirs):
    got = AutoModelForCausalLM.from_pretrained(bf16_dirs["llama"], quantization_config=TeSerialConfig(
        recipe="nvfp4", usages=["rowwise"], fused="off"))
    want = AutoModelForCausalLM.from_pretrained(bf16_dirs["llama"])
    ts.quantize_model(want, "nvfp4", columnwise=False, fused="off")
    _assert_same_model(got, want)
    attn = got.model.layers[0].self_attn
    amax = {m: getattr(attn, m).weight.buffers()["_amax_rowwise"] for m in ("q_proj", "k_proj", "v_proj")}
    assert len({float(a) for a in amax.values()}) > 1


def test_exclude_adds_to_te_serials_high_precision_rule(bf16_dirs):
    exclude = ["*.mlp.down_proj", "model.layers.1.self_attn.*"]
    got = AutoModelForCausalLM.from_pretrained(bf16_dirs["qwen2"], quantization_config=TeSerialConfig(
        recipe="fp8_block_1d", exclude=exclude, usages=["rowwise", "columnwise"]))
    want = AutoModelForCausalLM.from_pretrained(bf16_dirs["qwen2"])
    linears = [n for n, m in want.named_modules() if isinstance(m, torch.nn.Linear)]
    kept = [n for n in linears if not any(fnmatch.fnmatchcase(n, p) for p in exclude)]
    ts.quantize_model(want, "fp8_block_1d", include=kept, columnwise=True)  # the default rule still applies
    _assert_same_model(got, want)
    assert len(_quantized(got)) == 14 - 2 - 4 and "lm_head.weight" not in _quantized(got)


def test_a_weight_the_recipe_cannot_hold_stays_high_precision_with_a_warning(tmp_path):
    cfg = _config("llama", True, intermediate_size=200)  # MXFP8 needs multiples of 32
    _bf16_model(cfg).save_pretrained(tmp_path / "bf16")
    with pytest.warns(UserWarning, match="left unquantized") as caught:
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=TeSerialConfig(
            recipe="mxfp8", usages=["rowwise"]))
    named = {str(w.message).split()[1] for w in caught if "left unquantized" in str(w.message)}
    assert named == {f"model.layers.{i}.mlp.{m}.weight" for i in (0, 1) for m in ("gate_proj", "up_proj", "down_proj")}
    assert got.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert not isinstance(got.model.layers[0].mlp.up_proj.weight, tsf.QuantizedTensor)
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts.quantize_model(want, "mxfp8", columnwise=False)
    _assert_same_model(got, want)
    assert len(_quantized(got)) == 8  # attention only


# --- hub repositories (a huggingface_hub cache, read offline) ------------------------------------------

def _fake_hub(cache: Path, repo_id: str, src: Path, *, symlinks: bool, leave_out=()) -> Path:
    """``src``'s files as a hub download leaves them in ``cache``: ``models--org--name/refs/main``
    holding the commit, ``snapshots/<commit>/`` holding the files, as symlinks into ``blobs/``
    (huggingface_hub on Linux) or as plain files (where it cannot link). Returns the repository folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in sorted(src.iterdir()):
        if f.name in leave_out:
            continue
        if symlinks:
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            shutil.copyfile(f, blob)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
        else:
            shutil.copyfile(f, snapshot / f.name)
    return repo


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty hub cache that huggingface_hub and transformers use, offline (huggingface_hub reads
    HF_HUB_CACHE and HF_HUB_OFFLINE into its constants at import: both are set there)."""
    import huggingface_hub.constants as hub_constants
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.parametrize("symlinks, cache_dir", [(True, False), (False, True)])
def test_from_pretrained_of_a_hub_repository_equals_the_local_load(tmp_path, offline_hub, symlinks, cache_dir):
    """from_pretrained("org/name"): transformers downloads config.json, te-serial's weight index and
    the shards it names; te_serial.hf resolves the manifest into the same snapshot with
    transformers' cached_file, and te-serial's reader follows the snapshot's links to the
    repository's blobs (and no other link); the cache is left as it was."""
    path = _te_dir(tmp_path / "ck", "qwen2", "nvfp4", True)  # sharded
    cache = tmp_path / "elsewhere" if cache_dir else offline_hub
    repo = _fake_hub(cache, "someone/tiny-qwen2-nvfp4", path, symlinks=symlinks)
    blobs = sorted(os.listdir(repo / "blobs")) if symlinks else None
    where = {"cache_dir": str(cache), "revision": (repo / "refs" / "main").read_text()} if cache_dir else {}
    got = AutoModelForCausalLM.from_pretrained("someone/tiny-qwen2-nvfp4", **where)
    want = AutoModelForCausalLM.from_pretrained(path)
    _assert_same_model(got, want)
    _assert_same_logits(got, want)
    assert len(_quantized(got)) == 14 and got.config.quantization_config.recipe == "nvfp4"
    assert sorted(p.name for p in repo.iterdir()) == ["blobs"] * symlinks + ["refs", "snapshots"]
    if symlinks:  # the cache as it was: the blobs, and the snapshot's links to them
        assert sorted(os.listdir(repo / "blobs")) == blobs
        files = list((repo / "snapshots").glob("*/*"))
        assert len(files) == len(os.listdir(path)) and all(p.is_symlink() and p.exists() for p in files)


def test_a_hub_repository_without_the_manifest_is_a_te_serial_error(tmp_path, offline_hub):
    """No te_serial.msgpack in the repository: te-serial's CheckpointError names the repository and
    the manifest, with transformers' reason (not in the cache offline; known missing on the hub)."""
    path = _te_dir(tmp_path / "ck", "qwen2", "mxfp8", False)
    repo = _fake_hub(offline_hub, "someone/no-manifest", path, symlinks=True, leave_out={"te_serial.msgpack"})
    with pytest.raises(tse.CheckpointError, match=r"hub repository someone/no-manifest .*te_serial\.msgpack.*"
                                                  r"couldn't find them in the cached files"):
        AutoModelForCausalLM.from_pretrained("someone/no-manifest")
    commit = (repo / "refs" / "main").read_text()
    (repo / ".no_exist" / commit).mkdir(parents=True)  # what huggingface_hub records when the hub says 404
    (repo / ".no_exist" / commit / "te_serial.msgpack").touch()
    with pytest.raises(tse.CheckpointError, match=r"does not appear to have a file named te_serial\.msgpack"):
        AutoModelForCausalLM.from_pretrained("someone/no-manifest")


def test_a_hub_cache_link_that_leads_outside_its_blobs_is_refused(tmp_path, offline_hub):
    """te-serial follows a hub cache's links only to a blob of the same repository."""
    path = _te_dir(tmp_path / "ck", "qwen2", "mxfp8", False)
    repo = _fake_hub(offline_hub, "someone/odd-link", path, symlinks=True)
    manifest = next((repo / "snapshots").glob("*/te_serial.msgpack"))
    outside = tmp_path / "outside.msgpack"
    shutil.copyfile(manifest, outside)
    manifest.unlink()
    manifest.symlink_to(outside)
    with pytest.raises(tse.CheckpointError, match="symbolic link; te-serial does not follow links inside a "
                                                  "checkpoint except to a file in .*blobs"):
        AutoModelForCausalLM.from_pretrained("someone/odd-link")


# --- errors a user can act on -------------------------------------------------------------------------

def test_an_unknown_quantizer_kind_is_te_serials_manifest_error(tmp_path):
    from safety.safety_helpers import Ck
    path = _te_dir(tmp_path / "ck", "llama", "mxfp8", False)
    Ck(path).edit(lambda doc: [q.update(kind="fp8_from_the_future") for q in doc["quantizers"]])
    with pytest.raises(tse.ManifestError, match="fp8_from_the_future"):
        AutoModelForCausalLM.from_pretrained(path)


def test_a_config_json_from_another_checkpoint_is_refused(tmp_path):
    path = _te_dir(tmp_path / "ck", "llama", "mxfp8", False)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules"]["model.layers.0.mlp.up_proj"] = "nvfp4"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(tse.CheckpointError, match=r"disagrees with te_serial\.msgpack.*up_proj"):
        AutoModelForCausalLM.from_pretrained(path)


def test_without_te_serial_hf_transformers_quotes_the_install_hint(tmp_path, monkeypatch):
    """What a user who never imported te_serial.hf sees: transformers skips the unknown method, then
    refuses config.json's ``transformers_weights`` — the install hint save_quantized writes there —
    quoting it, before it looks for any weight (never random weights beside unexpected buffers)."""
    path = _te_dir(tmp_path / "ck", "llama", "mxfp8", False)
    assert json.loads((path / "config.json").read_text())["transformers_weights"] == tshf.HF_INSTALL_HINT
    got = AutoModelForCausalLM.from_pretrained(path)  # with te_serial.hf, the hint is not in the way
    assert not hasattr(got.config, "transformers_weights")
    assert AUTO_QUANTIZER_MAPPING["te_serial"] is tshf.TeSerialHfQuantizer  # importing te_serial.hf registered it
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["te_serial"] is TeSerialConfig
    monkeypatch.delitem(AUTO_QUANTIZER_MAPPING, "te_serial")
    monkeypatch.delitem(AUTO_QUANTIZATION_CONFIG_MAPPING, "te_serial")
    with pytest.raises(ValueError, match=re.escape(tshf.HF_INSTALL_HINT)):
        AutoModelForCausalLM.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())  # a config.json without the hint: no weights found
    del config["transformers_weights"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(OSError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(path)


def test_a_conversion_of_a_te_serial_directory_drops_its_hf_markers(tmp_path):
    """A BF16 conversion of a te-serial directory is a plain Hugging Face directory: no te-serial
    quantization_config and no install hint in its config.json, so transformers loads it by itself;
    a conversion that keeps the quantized tensors writes the marks for what the output holds."""
    path = _te_dir(tmp_path / "ck", "llama", "mxfp8", False)
    ts.convert(path, tmp_path / "bf16", recipe="bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "transformers_weights" not in config and "quantization_config" not in config
    assert config["architectures"] == json.loads((path / "config.json").read_text())["architectures"]
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")  # transformers alone reads it
    assert not _quantized(plain)
    # a conversion that keeps the quantized tensors keeps the directory's marks, for what it holds
    ts.convert(path, tmp_path / "same")
    again = json.loads((tmp_path / "same" / "config.json").read_text())
    assert again["quantization_config"] == json.loads((path / "config.json").read_text())["quantization_config"]
    _assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "same"),
                       AutoModelForCausalLM.from_pretrained(path))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_a_conversion_to_a_recipe_loads_through_from_pretrained(bf16_dirs, tmp_path, recipe):
    """te_serial.convert of a BF16 Hugging Face directory to a recipe writes a directory
    from_pretrained loads (quantization_config, install hint, weight index), holding what quantize on
    load of the same directory holds, byte for byte."""
    out = tmp_path / "out"
    ts.convert(bf16_dirs["llama"], out, recipe=recipe, usages="rowwise")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "te_serial"
    assert config["transformers_weights"] == tshf.HF_INSTALL_HINT and (out / tshf.HF_INDEX_NAME).is_file()
    got = AutoModelForCausalLM.from_pretrained(out)
    want = AutoModelForCausalLM.from_pretrained(bf16_dirs["llama"], quantization_config=TeSerialConfig(
        recipe=recipe, usages=["rowwise"]))
    assert _quantized(got) == _quantized(want) and _quantized(got)
    assert not any(p.requires_grad for n, p in got.named_parameters() if n in _quantized(got))  # as converted
    for a, b in zip(got.parameters(), want.parameters()):
        b.requires_grad_(a.requires_grad)
    _assert_same_model(got, want)
    _assert_same_logits(got, want)


def test_config_values_are_checked(bf16_dirs):
    with pytest.raises(tse.FormatError, match="unknown recipe"):
        TeSerialConfig(recipe="fp9")
    with pytest.raises(tse.FormatError, match="usages"):
        TeSerialConfig(recipe="mxfp8", usages=["sideways"])
    with pytest.raises(tse.ConversionError, match="fused"):
        TeSerialConfig(recipe="nvfp4", fused="sometimes")
    config = TeSerialConfig(recipe="nvfp4", exclude=["*.o_proj"], usages=["rowwise"], fused=[["q_proj", "k_proj"]])
    assert TeSerialConfig.from_dict(json.loads(json.dumps(config.to_dict()))).to_dict() == config.to_dict()
    with pytest.raises(tse.FormatError, match="needs a recipe"):
        AutoModelForCausalLM.from_pretrained(bf16_dirs["llama"], quantization_config=TeSerialConfig())


def test_save_pretrained_round_trips_and_push_to_hub_goes_through_it(tmp_path, monkeypatch):
    """save_pretrained of a te-serial model writes a te-serial directory (sharded as asked, with
    config.json, generation_config.json and the weight index) that from_pretrained loads to the same
    bytes; push_to_hub saves through it (the upload itself stubbed: no network here)."""
    path = _te_dir(tmp_path / "ck", "qwen2", "nvfp4", False)
    got = AutoModelForCausalLM.from_pretrained(path)
    got.save_pretrained(tmp_path / "out", max_shard_size="200KB")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"te_serial.msgpack", "config.json", "generation_config.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    _assert_same_model(again, got)
    _assert_same_logits(again, got)
    import transformers.utils.hub as hub
    uploaded = {}

    class _Api:
        def create_repo(self, repo_id, **kw):
            return type("Repo", (), {"repo_id": repo_id})()
    monkeypatch.setattr(hub, "hf_api", lambda: _Api())
    monkeypatch.setattr(hub, "create_and_tag_model_card",
                        lambda *a, **k: type("Card", (), {"save": lambda self, p: None})())
    monkeypatch.setattr(type(got), "_upload_modified_files",
                        lambda self, d, repo_id, **kw: uploaded.update({p.name: p.stat().st_size for p in Path(d).iterdir()}))
    got.push_to_hub("someone/tiny-qwen2-nvfp4", max_shard_size="200KB")
    assert "te_serial.msgpack" in uploaded and "config.json" in uploaded


def test_pipeline_and_generate_on_a_loaded_model(tmp_path):
    """generate with the KV cache, and pipeline("text-generation") built on the loaded model or on
    the directory itself, give the same tokens as the load_into model (greedy)."""
    from transformers import pipeline
    path = _te_dir(tmp_path / "ck", "llama", "fp8_block", True)
    got = AutoModelForCausalLM.from_pretrained(path)
    want = ts.load_into(_meta_model(_config("llama", True)), path)
    ids = _ids()[:, :8]
    out = got.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(out, want.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True))
    assert out.shape[1] == ids.shape[1] + 6
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(SMALL["vocab_size"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0", eos_token="t1")
    prompt = " ".join(f"t{int(i)}" for i in ids[0])
    pipe = pipeline("text-generation", model=got, tokenizer=tok)
    text = pipe(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    prompt_ids = torch.tensor([tok(prompt)["input_ids"]])
    expect = want.generate(prompt_ids, max_new_tokens=6, do_sample=False)[0, prompt_ids.shape[1]:]
    assert text == tok.decode(expect) and len(expect) == 6
    tok.save_pretrained(path)  # a directory with its tokenizer: pipeline loads both from it
    by_dir = pipeline("text-generation", model=str(path))
    assert isinstance(by_dir.model.model.layers[0].self_attn.q_proj.weight, tsf.QuantizedTensor)
    assert by_dir(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"] == text


def test_model_to_dtype_keeps_the_quantized_bytes_and_changes_the_nominal_dtype(tmp_path):
    """model.to(torch.float32): quantized weights keep their bytes and take float32 as their nominal
    (dequantized) dtype, plain ones are cast, as the same cast of the load_into model gives;
    .float() / .half() are refused by transformers itself for a quantized model."""
    path = _te_dir(tmp_path / "ck", "llama", "nvfp4", False)
    got = AutoModelForCausalLM.from_pretrained(path)
    want = ts.load_into(_meta_model(_config("llama", True)), path)
    saved = {n: {k: b.clone() for k, b in p.buffers().items()} for n, p in got.named_parameters()
             if isinstance(p, tsf.QuantizedTensor)}
    got.to(torch.float32)
    want.to(torch.float32)
    assert got.dtype == torch.float32 and got.model.norm.weight.dtype == torch.float32
    for name, p in got.named_parameters():
        if name in saved:
            assert isinstance(p, tsf.QuantizedTensor) and p.dtype == torch.float32, name
            assert all(torch.equal(b, saved[name][k]) for k, b in p.buffers().items()), name
    _assert_same_model(got, want)
    _assert_same_logits(got, want)
    with pytest.raises(ValueError, match="not supported for quantized model"):
        got.float()
    with pytest.raises(ValueError, match="not supported for quantized model"):
        got.half()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_map_cuda(tmp_path):
    """device_map="cuda": every quantized weight lands on the GPU with load_into's bytes."""
    path = _te_dir(tmp_path / "ck", "llama", "mxfp8", True)
    got = AutoModelForCausalLM.from_pretrained(path, device_map="cuda")
    want = ts.load_into(_meta_model(_config("llama", True)), path)
    for name, p in got.named_parameters():
        assert p.device.type == "cuda", name
        if isinstance(p, tsf.QuantizedTensor):
            q = dict(want.named_parameters())[name]
            for k, b in p.buffers().items():
                assert torch.equal(b.cpu().view(torch.uint8), q.buffers()[k].view(torch.uint8)), (name, k)


def test_peft_lora_trains_adapters_over_the_frozen_quantized_base(tmp_path, monkeypatch):
    """PEFT's LoRA on q/v of a from_pretrained te-serial model: forward and backward through the
    quantized weights' dequantize, finite gradients on every adapter, the loss falls after a step,
    and the base's bytes are unchanged."""
    import importlib.util
    if importlib.util.find_spec("peft") is None and not os.environ.get("CI"):  # the test extra installs it
        pytest.skip("peft not installed: pip install -c constraints.txt -e '.[test]'")
    import sys
    # peft probes transformer_engine at import; the CPU-only TE wheel raises there (and te_shim's
    # stand-in lacks TE's module classes): PEFT's path without TE, as on a machine without it
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    import peft
    import peft.import_utils
    peft.import_utils.is_te_pytorch_available.cache_clear()
    path = _te_dir(tmp_path / "ck", "llama", "mxfp8", True)
    model = AutoModelForCausalLM.from_pretrained(path)
    base = {n: {k: b.clone() for k, b in p.buffers().items()} for n, p in model.named_parameters()
            if isinstance(p, tsf.QuantizedTensor)}
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trainable = [p for p in pm.parameters() if p.requires_grad]
    assert trainable and not any(isinstance(p, tsf.QuantizedTensor) for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = _ids()
    loss = pm(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
    opt.step()
    with torch.no_grad():
        assert pm(ids, labels=ids).loss < loss
    now = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in pm.named_parameters()
           if isinstance(p, tsf.QuantizedTensor)}
    assert set(now) == set(base)
    for n, bufs in base.items():
        for k, b in bufs.items():
            assert torch.equal(now[n].buffers()[k].view(torch.uint8), b.view(torch.uint8)), (n, k)


# --- memory ------------------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith(field + ":")).split()[1])


def test_release_pages_takes_a_read_files_pages_out_of_the_process(tmp_path):
    """A file's pages read through mmap stop counting in the process's resident memory once released
    (they stay readable: the same bytes come back from the file)."""
    from te_serial.checkpoint.files import release_pages
    path = tmp_path / "f.bin"
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    data.numpy().tofile(path)
    mapped = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=64 << 20)
    t = torch.empty(0, dtype=torch.uint8).set_(mapped)
    assert int(t.sum()) == int(data.sum())  # every page read
    before = _status_kib("RssFile")
    release_pages(t)
    assert before - _status_kib("RssFile") >= 48 << 10  # KiB: most of the 64 MiB left the process
    assert torch.equal(t, data)


def test_quantize_on_load_holds_no_more_of_the_source_than_it_quantizes(tmp_path):
    """Quantize on load reads each BF16 weight through transformers (mmap'd file pages) and releases
    its pages once quantized: the peak resident memory grows by about the quantized model, not by
    the BF16 file beside it."""
    cfg = _config("llama", False, hidden_size=512, intermediate_size=2048, num_hidden_layers=8)
    src = tmp_path / "bf16"
    _bf16_model(cfg).save_pretrained(src)
    bf16_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    # a first load makes what every later one of these shapes reuses (imports, compiled kernels)
    AutoModelForCausalLM.from_pretrained(src, quantization_config=TeSerialConfig(recipe="mxfp8", usages=["rowwise"]))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS from here
    before = _status_kib("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=TeSerialConfig(recipe="mxfp8",
                                                                                       usages=["rowwise"]))
    grew = (_status_kib("VmHWM") - before) << 10
    held = sum(b.numel() * b.element_size() for p in model.parameters()
               for b in (p.buffers().values() if hasattr(p, "quantizer") else [p]))
    assert held < 0.6 * bf16_bytes  # MXFP8 weights, BF16 embeddings and norms
    assert grew < held + 0.25 * bf16_bytes, (grew, held, bf16_bytes)  # without the release: held + bf16_bytes
