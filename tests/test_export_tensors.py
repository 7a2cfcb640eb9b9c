"""``te_serial.export_tensors``: the serving export as a stream of (name, tensor), for weight sync
into an engine without files. It yields exactly what ``convert`` writes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import te_serial as ts
from te_serial.conversion import convert
from te_serial.errors import ConversionError

transformers = pytest.importorskip("transformers")
Q, K, V = (f"model.layers.0.self_attn.{p}_proj" for p in "qkv")


def _llama(path=None, layers=2):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=384, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        m.get_submodule(K).weight.mul_(3.0)
    if path is not None:
        m.save_pretrained(path)
    return m


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("recipe,layout", [("nvfp4", "modelopt_nvfp4"), ("nvfp4", "compressed_tensors_nvfp4"),
                                           ("fp8_current", "compressed_tensors_fp8_tensor"),
                                           ("mxfp8", "modelopt_mxfp8"), ("fp8_block", "compressed_tensors_fp8_block")])
def test_stream_from_a_model_is_what_convert_writes(recipe, layout, tmp_path):
    """A model quantized in memory (both usages, as for training) streams the bytes ``convert``
    writes from the same model saved: names, dtypes, shapes and bits."""
    m = ts.quantize_model(_llama(), recipe, columnwise=True)
    ts.save_quantized(m, tmp_path / "te")
    convert(tmp_path / "te", tmp_path / "out", recipe=layout)
    files = load_file(str(tmp_path / "out" / "model.safetensors"))
    got = dict(ts.export_tensors(m, layout))
    assert set(got) == set(files)
    for name, t in files.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_bits(got[name]), _bits(t)), name


def test_stream_from_a_checkpoint_in_buckets(tmp_path):
    _llama(tmp_path / "hf")
    whole = list(ts.export_tensors(tmp_path / "hf", "compressed_tensors_nvfp4"))
    limit = 1 << 16
    buckets = list(ts.export_tensors(tmp_path / "hf", "compressed_tensors_nvfp4", bucket_bytes=limit))
    flat = [pair for b in buckets for pair in b]
    assert [n for n, _ in flat] == [n for n, _ in whole]
    assert all(torch.equal(_bits(a), _bits(b)) for (_, a), (_, b) in zip(flat, whole))
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= limit or len(b) == 1


def test_a_trained_model_with_its_own_scales_is_shared_on_the_way_out(tmp_path):
    m = ts.quantize_model(_llama(), "nvfp4", columnwise=False, fused="off")   # as TE trains: each its own amax
    with pytest.warns(UserWarning, match="requantized to the group's shared amax"):
        got = dict(ts.export_tensors(m, "modelopt_nvfp4"))
    scales = [got[f"{n}.weight_scale_2"] for n in (Q, K, V)]
    assert all(torch.equal(s, scales[0]) for s in scales)
    assert float(scales[0]) == pytest.approx(float(m.get_submodule(K).weight.buffers()["_amax_rowwise"]) / 2688)


def test_only_serving_layouts(tmp_path):
    with pytest.raises(ConversionError, match="not a serving layout"):
        list(ts.export_tensors(_llama(), "mxfp8"))
