"""Models: quantize_model, plan, materialize, load_into (meta-built models filled from checkpoints)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import te_serial as ts
from te_serial import formats as tsf
from te_serial.model import LoadResult
from helpers import assert_same_tensor


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.attn(self.norm(x))
        return x + self.out(torch.relu(self.mlp(h)))


class Tiny(nn.Module):
    def __init__(self, vocab=96, d=64, layers=2, tied=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(16.0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def reset_parameters(self):  # its own buffers' values: how load_into / materialize fill them on meta
        with torch.no_grad():
            self.positions.copy_(torch.arange(16.0))
            self.scratch.zero_()

    def forward(self, ids):
        x = self.embed(ids) + self.positions[: ids.shape[-1], None]
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))


RECIPES = ["fp8_current", "mxfp8", "mxfp8_2d", "fp8_block", "fp8_block_1d", "nvfp4", "nvfp4_2d", "fp8_delayed"]


def _trained(recipe, seed=0):
    torch.manual_seed(seed)
    m = Tiny()
    ts.quantize_model(m, recipe, columnwise=True)
    return m


def _assert_same_model(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert_same_tensor(sb[k], sa[k], k)


@pytest.mark.parametrize("recipe", RECIPES)
def test_meta_model_loaded_equals_saved_model(tmp_path, recipe):
    src = _trained(recipe)
    ts.save_quantized(src, tmp_path / "ck")
    with torch.device("meta"):
        dst = Tiny()
    ts.quantize_model(dst, recipe, columnwise=True)
    out = ts.load_into(dst, tmp_path / "ck", device="cpu")
    assert out is dst
    _assert_same_model(dst, src)
    assert all(p.device.type == "cpu" for p in dst.parameters())
    assert isinstance(dst.blocks[0].mlp.weight, nn.Parameter) and isinstance(dst.blocks[0].mlp.weight, tsf.QuantizedTensor)
    assert dst.lm_head.weight is dst.embed.weight  # tied stays tied
    ids = torch.randint(0, 96, (2, 10))
    assert torch.equal(dst(ids), src(ids))  # forward on CPU through the dequantize fallback


def test_load_into_plain_meta_model_without_quantize(tmp_path):
    src = _trained("mxfp8")
    ts.save_quantized(src, tmp_path / "ck.safetensors")
    with torch.device("meta"):
        dst = Tiny()  # plain meta model: the checkpoint's quantized tensors replace its weights
    ts.load_into(dst, tmp_path / "ck.safetensors")
    _assert_same_model(dst, src)


def test_requires_grad_and_buffers_follow_the_checkpoint(tmp_path):
    src = _trained("nvfp4")
    src.blocks[1].out.weight.requires_grad_(False)
    ts.save_quantized(src, tmp_path / "ck")
    with torch.device("meta"):
        dst = Tiny()
    ts.load_into(dst, tmp_path / "ck")
    assert dst.blocks[0].out.weight.requires_grad and not dst.blocks[1].out.weight.requires_grad
    assert torch.equal(dst.positions, torch.arange(16.0))
    # non-persistent: in no checkpoint, initialized by the module's reset_parameters (never left on meta)
    assert "scratch" not in dst.state_dict() and torch.equal(dst.scratch, torch.zeros(3))


def test_strict_and_non_strict_key_handling(tmp_path):
    src = _trained("mxfp8")
    sd = src.state_dict()
    sd.pop("blocks.1.out.bias")
    sd["extra.thing"] = torch.zeros(2)
    ts.save_quantized(sd, tmp_path / "ck")
    with torch.device("meta"):
        dst = Tiny()
    with pytest.raises(ts.CheckpointError, match=r"missing keys \['blocks.1.out.bias'\].*unexpected keys \['extra.thing'\]"):
        ts.load_into(dst, tmp_path / "ck")
    res = ts.load_into(dst, tmp_path / "ck", strict=False)
    assert isinstance(res, LoadResult) and res.model is dst
    assert res.missing_keys == ["blocks.1.out.bias"] and res.unexpected_keys == ["extra.thing"]
    assert dst.blocks[0].out.bias.device.type == "cpu"
    bias = dst.blocks[1].out.bias  # missing: initialized by nn.Linear.reset_parameters, weight untouched
    assert bias.device.type == "cpu" and torch.isfinite(bias).all() and bias.abs().max() <= 256 ** -0.5
    assert_same_tensor(dst.blocks[1].out.weight, src.blocks[1].out.weight, "blocks.1.out.weight")


def test_tied_weight_saved_under_one_name_only(tmp_path):
    src = _trained("fp8_current")
    sd = src.state_dict()
    sd.pop("lm_head.weight")
    ts.save_quantized(sd, tmp_path / "ck")
    with torch.device("meta"):
        dst = Tiny()
    ts.load_into(dst, tmp_path / "ck")  # strict: lm_head.weight is the tied partner of embed.weight
    assert dst.lm_head.weight is dst.embed.weight and dst.embed.weight.device.type == "cpu"


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    ts.save_quantized(Tiny(d=32, vocab=96, layers=2), tmp_path / "small")
    with torch.device("meta"):
        dst = Tiny(d=64)
    with pytest.raises(ts.CheckpointError, match=r"size mismatch for embed.weight: checkpoint \[96, 32\] vs model \[96, 64\]"):
        ts.load_into(dst, tmp_path / "small", strict=False)


def test_assign_false_copies_into_existing_tensors(tmp_path):
    src = _trained("fp8_block")
    ts.save_quantized(src, tmp_path / "ck")
    dst = _trained("fp8_block", seed=1)
    before = dst.blocks[0].mlp.weight
    ts.load_into(dst, tmp_path / "ck", assign=False)
    assert dst.blocks[0].mlp.weight is before  # same object, new bytes
    _assert_same_model(dst, src)


def test_quantize_model_include_exclude_rules():
    m = Tiny(tied=False)
    ts.quantize_model(m, "mxfp8", columnwise=False)
    kinds = {n: type(p).__name__ for n, p in m.named_parameters()}
    assert kinds["blocks.0.attn.weight"] == kinds["blocks.1.out.weight"] == "MXFP8Tensor"
    assert kinds["embed.weight"] == kinds["lm_head.weight"] == kinds["norm.weight"] == "Parameter"
    assert kinds["blocks.0.attn.bias"] == "Parameter"
    m = Tiny(tied=False)
    ts.quantize_model(m, ts.NVFP4Quantizer(), include=["blocks.*.mlp", "lm_head"], exclude=["blocks.1.*"])
    quantized = sorted(n for n, p in m.named_parameters() if isinstance(p, tsf.QuantizedTensor))
    assert quantized == ["blocks.0.mlp.weight", "lm_head.weight"]
    assert m.lm_head.weight.quantizer == ts.NVFP4Quantizer()


def test_quantize_model_skips_shapes_the_recipe_cannot_hold():
    m = nn.Sequential(nn.Linear(48, 64), nn.Linear(64, 64))
    with pytest.warns(UserWarning, match="0.weight left unquantized"):
        ts.quantize_model(m, "mxfp8")
    assert not isinstance(m[0].weight, tsf.QuantizedTensor) and isinstance(m[1].weight, tsf.QuantizedTensor)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4_2d", "fp8_block", "fp8_current"])
def test_plan_on_meta_equals_real_sizes_after_loading(tmp_path, recipe):
    src = _trained(recipe)
    ts.save_quantized(src, tmp_path / "ck")
    with torch.device("meta"):
        meta = Tiny()
    ts.quantize_model(meta, recipe, columnwise=True)
    p = ts.plan(meta)
    estimate = ts.plan(Tiny(), recipe, columnwise=True)  # from a plain model, leaving it unchanged
    assert estimate.total_bytes == p.total_bytes
    ts.load_into(meta, tmp_path / "ck")
    seen, real = set(), 0
    for t in list(meta.parameters()) + [meta.positions]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        real += t.quantized_nbytes() if isinstance(t, tsf.QuantizedTensor) else t.numel() * t.element_size()
    assert p.total_bytes == real == ts.open(tmp_path / "ck").manifest.nbytes()
    assert p.by_kind()[ts.recipes.recipe_quantizer(recipe).kind] > 0 and "total" in str(p)


def test_materialize_allocates_quantized_parameters_from_prototypes():
    with torch.device("meta"):
        m = Tiny()
    ts.quantize_model(m, "nvfp4", columnwise=True)
    ts.materialize(m, "cpu")
    assert all(t.device.type == "cpu" for t in m.state_dict().values())
    w = m.blocks[0].mlp.weight
    assert isinstance(w, tsf.NVFP4Tensor) and set(w.buffers()) == set(ts.NVFP4Quantizer().describe_buffers((256, 64)))
    assert m.lm_head.weight is m.embed.weight
    assert m.scratch.device.type == "cpu" and torch.equal(m.positions, torch.arange(16.0))
    assert torch.isfinite(w.dequantize()).all() and w.dequantize().abs().max() > 0  # initialized, then quantized
    assert w.requires_grad and isinstance(w, nn.Parameter)


def test_quantized_model_state_dict_round_trips(tmp_path):
    src = _trained("mxfp8")
    ts.save_quantized(src.state_dict(), tmp_path / "sd.safetensors")
    back = ts.load_quantized(tmp_path / "sd.safetensors")
    ref = src.state_dict()
    assert list(back) == list(ref)
    for k in ref:
        assert type(back[k]) is type(ref[k])


def test_load_into_another_dtype_with_parameters_that_require_grad(tmp_path):
    """Plain parameters saved with requires_grad=True, loaded into a model of another dtype: cast,
    their figures taken, and they keep requiring grad (the comparison made no autograd graph)."""
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256)).to(torch.bfloat16)
    ts.quantize_model(m, "mxfp8")
    ts.save_quantized(m, tmp_path / "c")
    with torch.device("meta"):
        m2 = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256)).float()
    ts.load_into(m2, tmp_path / "c")
    assert m2[1].weight.dtype == torch.float32 and m2[1].weight.requires_grad
    assert torch.equal(m2[1].weight, m[1].weight.float()) and torch.equal(m2[0].bias, m[0].bias.float())
