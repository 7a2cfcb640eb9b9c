"""vLLM (0.33.0, its real MoE models, FusedMoE weight loaders and post-load processing, on CPU; see
vllm_harness.py) loads te-serial's serving exports of quantized MoE models (issue 36) and holds the
values te-serial's 3-D experts have.

The exports come from ``quantize_model`` (transformers 5's 3-D expert parameters quantized one
expert at a time) + ``save_quantized`` + ``convert`` to the layout: the experts are written under
the per-expert names the engines read (Qwen's ``mlp.experts.<i>.gate_proj``, Mixtral's
``block_sparse_moe.experts.<i>.w1``), with per-expert scales. vLLM stacks them into
``w13_weight`` [E, 2I, H] (gate rows, then up rows: each te-serial expert's own order) and
``w2_weight``; its MXFP8 emulation backend dequantizes them to BF16 at load, which must equal
te-serial's dequantized experts bit for bit. Before this, the exports wrote the experts under
transformers' in-memory 3-D names, which vLLM's Qwen3-MoE loader took with scales left unset.
"""

from __future__ import annotations


import pytest
import torch

import te_serial as ts


def _values(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What vLLM holds, as BF16 values: its MXFP8 emulation's BF16 dequantization as it is, or
    (compressed-tensors keeps the codes) E4M3 codes × 2^(E8M0 − 127) per 32 elements along K."""
    if weight.dtype == torch.bfloat16:
        return weight
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.uint8
    factor = torch.exp2(scale.float() - 127.0).repeat_interleave(32, dim=-1)
    return (weight.float() * factor).to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["modelopt_mxfp8", "compressed_tensors_mxfp8"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_vllm_holds_te_serial_expert_values(arch, layout, tmp_path):
    from test_moe import build
    from vllm_harness import load_experts_with_vllm
    model = ts.quantize_model(build(arch), "mxfp8", columnwise=False)
    ts.save_quantized(model, tmp_path / "te")
    ts.convert(tmp_path / "te", tmp_path / "out", recipe=layout)
    held = load_experts_with_vllm(tmp_path / "out")
    ours = dict(model.named_parameters())
    layers = sorted({n.rsplit(".experts.", 1)[0] for n in ours if ".experts." in n})
    assert len(held) == len(layers) == 2
    for layer in layers:
        got = next(v for k, v in held.items() if k.startswith(layer.replace(".mlp", "") + ".")
                   or k.startswith(layer + "."))
        assert "MxFp8" in got["quant_method"] or "Mxfp8" in got["quant_method"], got["quant_method"]
        for vllm_name, ours_name in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj")):
            want = ours[f"{layer}.experts.{ours_name}"].dequantize(torch.bfloat16)
            have = _values(got[vllm_name], got[f"{vllm_name}_scale"])
            assert have.shape == want.shape
            assert torch.equal(have.view(torch.int16), want.view(torch.int16)), (layer, vllm_name)


def _static_export_in_vllm(arch: str, recipe: str, layout: str, tmp_path):
    """(te-serial's model, what vLLM holds of its experts) for a static export: ``arch`` quantized to
    ``recipe``, its expert inputs calibrated with ActivationAmax, converted to ``layout``."""
    from te_serial.conversion import ActivationAmax
    from test_moe import build
    from vllm_harness import load_experts_with_vllm
    model = ts.quantize_model(build(arch), recipe, columnwise=False)
    with ActivationAmax(model) as cal, torch.no_grad():
        model(torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(5)))
    ts.save_quantized(model, tmp_path / "te")
    ts.convert(tmp_path / "te", tmp_path / "out", recipe=layout, activation_amax=cal.amax)
    return model, load_experts_with_vllm(tmp_path / "out")


@pytest.mark.parametrize("layout", ["modelopt_nvfp4", "compressed_tensors_nvfp4"])
def test_vllm_holds_te_serial_nvfp4_expert_codes_scales_and_one_global_scale_per_expert(layout, tmp_path):
    """A static (W4A4) NVFP4 MoE export, calibrated with ActivationAmax: vLLM's FusedMoE loaders hold
    each expert's E2M1 codes and E4M3 block scales byte for byte (gate rows, then up rows: the
    te-serial expert's own order), and one global scale per expert (gate and up share it) equal to
    te-serial's amax / (6 × 448), within vLLM's own fp32 rounding of the layout's convention (1 ulp)."""
    model, held = _static_export_in_vllm("qwen3_moe", "nvfp4", layout, tmp_path)
    ours = dict(model.named_parameters())
    assert len(held) == 2
    for layer in ("model.layers.0.mlp", "model.layers.1.mlp"):
        got = next(v for k, v in held.items() if k.startswith(layer + "."))
        assert "Nvfp4" in got["quant_method"] or "NvFp4" in got["quant_method"], got["quant_method"]
        for vllm_name, ours_name in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj")):
            t = ours[f"{layer}.experts.{ours_name}"]
            for e, member in enumerate(t.members()):
                bufs = member.buffers()
                rows, k = member.shape
                assert torch.equal(got[vllm_name][e].view(torch.uint8), bufs["_rowwise_data"].view(torch.uint8))
                scale = got[f"{vllm_name}_scale"][e].view(torch.uint8)
                assert torch.equal(scale, bufs["_rowwise_scale_inv"][:rows, :k // 16].view(torch.uint8))
                g = got[f"{vllm_name}_scale_2"].reshape(t.shape[0], -1)[e].float()
                want = bufs["_amax_rowwise"].float().reshape(()) / (6.0 * 448.0)
                assert torch.all((g - want).abs() <= torch.finfo(torch.float32).eps * want.abs()), (layer, e)


@pytest.mark.parametrize("layout", ["modelopt_fp8", "compressed_tensors_fp8_tensor"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_vllm_holds_te_serial_per_tensor_fp8_expert_codes_and_one_scale_per_expert(arch, layout, tmp_path,
                                                                                     monkeypatch):
    """A static (W8A8) per-tensor FP8 MoE export, calibrated with ActivationAmax: vLLM's FusedMoE
    loaders and post-load step hold each expert's one te-serial scale (gate and up of an expert are
    one te-serial tensor, so they share it, and vLLM's max of the two is that scale) and its E4M3
    codes: down_proj byte for byte; gate/up as vLLM's own requantization to that scale leaves them
    (it always requantizes, through FP16, which moves the codes of FP16-subnormal values).
    vLLM 0.33's FP8 MoE oracle finds no per-tensor backend on CPU (its CPU FP8 experts are 128-block
    W8A16 on AMX): where it finds none, this test gives the ModelOpt and compressed-tensors methods
    its Triton experts, whose load-time step leaves the weights as they are (as stub 7 does for
    NVFP4). Everything before is vLLM's own; only the weights are checked, no GEMM runs."""
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe. \
        compressed_tensors_moe_w8a8_fp8 as ct_fp8
    import vllm.model_executor.layers.quantization.modelopt as modelopt
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, select_fp8_moe_backend

    def select(*args, **kwargs):
        backend, experts = select_fp8_moe_backend(*args, **kwargs)
        return (Fp8MoeBackend.TRITON, TritonExperts) if backend == Fp8MoeBackend.NONE else (backend, experts)
    for module in (modelopt, ct_fp8):
        monkeypatch.setattr(module, "select_fp8_moe_backend", select)
    model, held = _static_export_in_vllm(arch, "fp8_current", layout, tmp_path)
    ours = dict(model.named_parameters())
    layers = sorted({n.rsplit(".experts.", 1)[0] for n in ours if ".experts." in n})
    assert len(held) == len(layers) == 2
    for layer in layers:
        got = next(v for k, v in held.items() if k.startswith(layer.removesuffix(".mlp") + "."))
        assert "Fp8" in got["quant_method"] or "FP8" in got["quant_method"], got["quant_method"]
        for vllm_name, ours_name in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj")):
            members = ours[f"{layer}.experts.{ours_name}"].members()
            scales = got[f"{vllm_name}_scale"].reshape(len(members), -1)
            assert scales.shape[1] == 1, scales.shape        # one scale per expert after post-load
            for e, member in enumerate(members):
                bufs = member.buffers()
                scale = bufs["_scale_inv"].float().reshape(1)
                assert torch.equal(scales[e].float(), scale), (layer, e)
                codes = bufs["_data"].view(torch.float8_e4m3fn)
                if vllm_name == "w13_weight":  # vLLM requantizes gate and up to their max scale, which is
                    # this one scale, through FP16 (per_tensor_dequantize, then scaled_fp8_quant): the codes
                    # of an expert's FP16-subnormal values move; every other code stays ours
                    s = scale.reshape(())  # 0-d, as vLLM indexes it: FP16 × it stays FP16
                    codes = ((codes.to(torch.float16) * s).float() * torch.reciprocal(s)).clamp(
                        -448.0, 448.0).to(torch.float8_e4m3fn)
                assert torch.equal(got[vllm_name][e].view(torch.uint8), codes.view(torch.uint8)), (layer, e)
