"""Load a te-serial serving export with vLLM's real model code on CPU and return what vLLM holds.

``load_with_vllm(export_dir)`` builds vLLM's ``ModelConfig``/``VllmConfig`` from the export
(vLLM detects ``quant_method`` — ``modelopt`` / ``compressed-tensors`` / ``mxfp4`` — from ``config.json`` /
``hf_quant_config.json`` itself), constructs vLLM's ``LlamaForCausalLM`` through
``vllm.model_executor.model_loader.utils.initialize_model``, streams every tensor of the export's
``*.safetensors`` (vLLM's ``safetensors_weights_iterator``) through ``model.load_weights``, runs
``vllm.model_executor.model_loader.utils.process_weights_after_loading`` (each layer's
``quant_method.process_weights_after_loading``: ModelOpt's global-scale max, compressed-tensors'
``requantize_with_max_scale``, the kernels' own post-load steps), and returns, per module holding
quantized weights, clones of its parameters and buffers.

``load_experts_with_vllm`` / ``load_modules_with_vllm`` do the same for any architecture vLLM
resolves from ``config.json`` (its MoE models: the experts modules / every module), with
``moe_backend`` (vLLM's ``--moe-backend``) and ``post_load=False`` (stop after the weight loaders,
where a post-load step cannot run on CPU).

``vllm_values(held, module, scheme)`` turns what vLLM holds for one module into the fp32
``[N_total, K]`` weight it implies, with vLLM's semantics (see the function).

Tested with vLLM 0.33.0 (installed ``--no-deps`` next to torch 2.13.0+cpu, see
``requirements.txt``); the wheel is a CUDA build whose ``vllm._C`` does not load on a CPU-only
torch.

Stubs (everything else is vLLM's own code):

1. Platform: ``VLLM_TARGET_DEVICE=cpu`` (set if unset, at import of this module; it must come
   before vLLM is first imported and used in the process) so vLLM picks its CPU platform.
2. Kernel choice, NVFP4: vLLM registers no NVFP4 linear kernel for ``PlatformEnum.CPU``; the
   harness adds ``[EmulationNvFp4LinearKernel]`` (vLLM's own dequantize-then-matmul fallback, the
   one ROCm uses) to ``kernels.linear._POSSIBLE_NVFP4_KERNELS[CPU]``. Its post-load step only moves
   the E2M1 table; the block scales stay unswizzled ([N, K/16] E4M3).
3. Kernel choice, MXFP8: likewise ``[EmulationMxfp8LinearKernel]`` in
   ``_POSSIBLE_MXFP8_KERNELS[CPU]``. Its post-load step (``VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD``,
   default on) replaces the weight by vLLM's own BF16 dequantization (``dequant_mxfp8_to_bf16``).
4. Kernel choice, 128x128 block FP8: vLLM's CPU block kernels need ``vllm._C`` (AMX prepacking);
   the harness puts ``_CpuBlockWiseTorchFP8`` — vLLM's ``BlockWiseTorchFP8ScaledMMLinearKernel``
   with ``is_supported`` answering yes on CPU, nothing else changed — first in
   ``_POSSIBLE_FP8_BLOCK_KERNELS[CPU]``. Post-load is the block kernels' base step
   (``process_fp8_weight_block_strategy``: a no-op off ROCm FNUZ), weight kept [N, K], scale
   [N/128, K/128] fp32. (Per-tensor / per-channel FP8 needs no stub: vLLM's CPU list already
   falls back to its pure-torch ``PerTensorTorchFP8ScaledMMLinearKernel`` /
   ``ChannelWiseTorchFP8ScaledMMLinearKernel``, whose post-load step is a no-op.)
5. Kernel choice, unquantized layers (embedding, lm_head): ``layers.utils.check_cpu_sgl_kernel``
   answers False, so ``dispatch_cpu_unquantized_gemm`` takes its ``torch.nn.functional.linear``
   fallback instead of the AMX ``_C.convert_weight_packed`` path (no ``_C``).
6. One missing ``_C`` op, not a GEMM: ``torch.ops._C.static_scaled_fp8_quant`` (called by
   ``ops.scaled_fp8_quant`` inside vLLM's ``requantize_with_max_scale``, the compressed-tensors
   per-tensor FP8 fused-shard requantization) is registered with a CPU implementation transcribed
   from vLLM's CUDA kernel (csrc/quantization/w8a8/fp8/common.cu/.cuh,
   ``scaled_fp8_quant_kernel_strided`` + ``scaled_fp8_conversion<true>``):
   ``e4m3_rne(clamp(float(x) * (1.0f / scale), -448, 448))``, per-tensor scale only (the only use
   here). Registered only if ``_C`` lacks it.

7. MoE kernel choice, NVFP4: vLLM's NVFP4 MoE oracle finds no backend on CPU; the harness lets
   its own ``Nvfp4QuantizationEmulationTritonExperts`` (the EMULATION backend) report the CPU as a
   supported device, nothing else changed. Its post-load step keeps the packed E2M1 weights and the
   E4M3 block scales as loaded, and one ``w13_weight_scale_2`` per expert (gate and up share it).

8. Kernel choice, MXFP4 linear (compressed-tensors ``mxfp4-pack-quantized``,
   ``CompressedTensorsW4A4Mxfp4``): vLLM registers no MXFP4 linear kernel for ``PlatformEnum.CPU``;
   the harness adds ``_CpuEmulationMxfp4`` — vLLM's own ``EmulationMxfp4LinearKernel`` (dequantize,
   then ``F.linear``; the one CUDA and ROCm fall back to) with ``can_implement`` answering from the
   kernel's own ``_supports_quant_scheme`` instead of also asking for the ``amd-quark`` package —
   to ``_POSSIBLE_MXFP4_KERNELS[CPU]``. amd-quark is not installed: vLLM needs it only to dequantize
   in the forward pass (``dequant_mxfp4`` imports it there), which these tests do not run; its
   post-load step (``VLLM_MXFP4_EMULATION_DEQUANT_AT_LOAD`` off, vLLM's default) keeps the packed
   E2M1 ``weight`` [N, K/2] and the E8M0 ``weight_scale`` [N, K/32] as loaded.
9. MoE kernel choice, MXFP4 (gpt-oss's ``GptOssMxfp4MoEMethod``): the experts are loaded with
   ``moe_backend="emulation"`` (vLLM's own ``--moe-backend`` option, passed through ``KernelConfig``;
   with "auto", vLLM's CPU backend ``CPUExpertsMxfp4`` is chosen where the CPU has AMX, and its
   post-load step needs ``_C.convert_weight_packed``). That backend's experts,
   ``OCP_MXQuantizationEmulationTritonExperts``, report the CPU as a supported device and are
   supported without amd-quark (the same reason as stub 8: only its ``apply`` dequantizes);
   nothing else changed. Its post-load step (``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``,
   EMULATION) keeps ``w13_weight`` / ``w2_weight`` (packed E2M1), their E8M0 scales and the BF16
   biases as loaded.

Distributed: a single-process gloo group (world size 1, TP=1, PP=1) is created for each load and
torn down after it, so nothing stays initialized for other tests in the same process.
"""

from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

__all__ = ["load_with_vllm", "load_experts_with_vllm", "load_modules_with_vllm", "vllm_values", "SCHEME_OF_LAYOUT",
           "E2M1"]

#: te-serial serving layout -> the weight scheme vllm_values applies
SCHEME_OF_LAYOUT = {
    "modelopt_nvfp4": "nvfp4", "compressed_tensors_nvfp4": "nvfp4",
    "modelopt_fp8": "fp8_tensor", "compressed_tensors_fp8_tensor": "fp8_tensor",
    "compressed_tensors_fp8": "fp8_channel",
    "modelopt_mxfp8": "mxfp8", "compressed_tensors_mxfp8": "mxfp8",
    "modelopt_fp8_pb_wo": "fp8_block", "compressed_tensors_fp8_block": "fp8_block",
    "compressed_tensors_mxfp4": "mxfp4",
}

#: E2M1 magnitudes by code & 7; code bit 3 is the sign
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)

_PATCHED = False
_LIBS: list = []


def _patch_vllm() -> None:
    """Apply the stubs listed in the module docstring (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    import vllm.model_executor.kernels.linear as kl
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import BlockWiseTorchFP8ScaledMMLinearKernel
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        raise RuntimeError(f"vLLM resolved its platform to {type(current_platform).__name__}, not CPU: vLLM was "
                           "imported and used before VLLM_TARGET_DEVICE=cpu was set (set it before any "
                           "import of vllm; tests/consumers/conftest.py does)")

    class _CpuBlockWiseTorchFP8(BlockWiseTorchFP8ScaledMMLinearKernel):
        """vLLM's torch._scaled_mm block kernel, allowed on CPU (post-load step unchanged)."""

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

    kl._POSSIBLE_NVFP4_KERNELS.setdefault(PlatformEnum.CPU, [kl.EmulationNvFp4LinearKernel])
    kl._POSSIBLE_MXFP8_KERNELS.setdefault(PlatformEnum.CPU, [kl.EmulationMxfp8LinearKernel])
    kl._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU] = [_CpuBlockWiseTorchFP8,
                                                         *kl._POSSIBLE_FP8_BLOCK_KERNELS.get(PlatformEnum.CPU, [])]
    layer_utils.check_cpu_sgl_kernel = lambda n, k, dtype: False

    if not hasattr(torch.ops._C, "static_scaled_fp8_quant"):
        lib = torch.library.Library("_C", "FRAGMENT")
        lib.define("static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
                   "int[]? group_shape=None) -> ()")

        def static_scaled_fp8_quant(result, input, scale, group_shape=None):
            if scale.numel() != 1:
                raise NotImplementedError("harness: only per-tensor static_scaled_fp8_quant")
            inv = torch.reciprocal(scale.reshape(()).to(torch.float32))       # 1.0f / scale
            x = (input.to(torch.float32) * inv).clamp(-448.0, 448.0)           # val * inv, clamp
            result.copy_(x.to(result.dtype))                                   # RNE to e4m3

        lib.impl("static_scaled_fp8_quant", static_scaled_fp8_quant, "CPU")
        _LIBS.append(lib)  # keep the registration alive
    # stub 7: vLLM's own NVFP4 emulation MoE experts (dequantize, then its Triton-free torch path)
    # allowed on the CPU platform, as the MXFP8 emulation experts already are
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts)
    Nvfp4QuantizationEmulationTritonExperts._supports_current_device = staticmethod(lambda: True)

    # stub 8: vLLM's MXFP4 emulation linear kernel on CPU, without amd-quark (needed only in apply)
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Static

    class _CpuEmulationMxfp4(kl.EmulationMxfp4LinearKernel):
        """vLLM's MXFP4 emulation kernel, allowed without amd-quark (post-load step unchanged)."""

        @classmethod
        def can_implement(cls, config):
            if cls._supports_quant_scheme(kMxfp4Static, config.activation_quant_key):
                return True, None
            return False, f"activation {config.activation_quant_key} not emulated"

    kl._POSSIBLE_MXFP4_KERNELS.setdefault(PlatformEnum.CPU, [_CpuEmulationMxfp4])
    # stub 9: vLLM's OCP MX emulation MoE experts on the CPU platform, without amd-quark
    from vllm.model_executor.layers.fused_moe.experts.ocp_mx_emulation_moe import (
        OCP_MXQuantizationEmulationTritonExperts)
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    OCP_MXQuantizationEmulationTritonExperts._supports_current_device = staticmethod(lambda: True)
    OCP_MXQuantizationEmulationTritonExperts.is_supported_config = staticmethod(
        lambda cls, *args, **kwargs: TritonExperts.is_supported_config(cls, *args, **kwargs))
    _PATCHED = True


def _quantized_linear(module) -> bool:
    from vllm.model_executor.layers.linear import LinearBase
    qm = getattr(module, "quant_method", None)
    return isinstance(module, LinearBase) and qm is not None and not type(qm).__name__.startswith("Unquantized")


def _loaded_model(export_dir, *, moe_backend: str = "auto", post_load: bool = True):
    """vLLM's model for ``export_dir`` (config.json + *.safetensors), its weights streamed through
    ``load_weights`` and (``post_load``) post-load processing done, on CPU. ``moe_backend``: vLLM's
    ``--moe-backend`` option."""
    from vllm.config import (DeviceConfig, KernelConfig, LoadConfig, ModelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                 init_distributed_environment, initialize_model_parallel)
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.utils.torch_utils import set_default_torch_dtype

    _patch_vllm()
    export_dir = str(Path(export_dir))
    files = sorted(glob.glob(os.path.join(export_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {export_dir}")
    model_config = ModelConfig(model=export_dir, tokenizer=export_dir, skip_tokenizer_init=True,
                               dtype="bfloat16", enforce_eager=True)
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"),
                             kernel_config=KernelConfig(moe_backend=moe_backend))
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{os.path.join(tmp, 'pg')}")
        try:
            initialize_model_parallel(1, 1)
            with set_default_torch_dtype(model_config.dtype), device:
                model = initialize_model(vllm_config=vllm_config, model_config=model_config)
            model.load_weights(safetensors_weights_iterator(files, False))
            if post_load:
                process_weights_after_loading(model, model_config, device)
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    return model


def _held(module) -> dict[str, torch.Tensor]:
    d = {k: v.detach().clone() for k, v in module.named_parameters(recurse=False)}
    d.update({k: v.detach().clone() for k, v in module.named_buffers(recurse=False) if v is not None})
    return d


def load_with_vllm(export_dir) -> dict[str, dict[str, torch.Tensor]]:
    """Load ``export_dir`` (config.json + *.safetensors of a tiny LlamaForCausalLM serving export)
    with vLLM on CPU; return ``{module name: {tensor name: clone}}`` for every linear module whose
    quant_method is a quantized one, after vLLM's post-load processing. Each module's dict also
    has ``"logical_widths"`` (int64, vLLM's ``layer.logical_widths``: the fused shards' widths)."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, module in _loaded_model(export_dir).named_modules():
        if not _quantized_linear(module):
            continue
        held[name] = _held(module)
        held[name]["logical_widths"] = torch.tensor(list(module.logical_widths), dtype=torch.int64)
    return held


def load_modules_with_vllm(export_dir, *, moe_backend: str = "auto",
                           post_load: bool = True) -> dict[str, dict]:
    """Load ``export_dir`` with vLLM on CPU; return ``{module name: {tensor name: clone}}`` for every
    module holding parameters or buffers of its own, after post-load processing (``post_load=False``:
    as the weight loaders left them, no module post-processed). A module with a quant method also
    has ``"quant_method"`` (its class name, a str) and ``"experts"`` (the class name of the MoE
    experts kernel its post-load step built, "" where none was). ``moe_backend``: vLLM's
    ``--moe-backend`` option."""
    held: dict[str, dict] = {}
    for name, module in _loaded_model(export_dir, moe_backend=moe_backend, post_load=post_load).named_modules():
        h = _held(module)
        if not h:
            continue
        qm = getattr(module, "quant_method", None)
        if qm is not None:
            h["quant_method"] = type(qm).__name__
            kernel = getattr(qm, "moe_kernel", None)   # built at post-load
            h["experts"] = type(kernel.fused_experts).__name__ if kernel is not None else ""
        held[name] = h
    return held


def load_experts_with_vllm(export_dir, *, moe_backend: str = "auto",
                           post_load: bool = True) -> dict[str, dict]:
    """Load a MoE serving export with vLLM on CPU (its FusedMoE loaders stack the per-expert
    checkpoint tensors into ``w13_weight`` [E, 2I, H] = gate rows then up rows, and ``w2_weight``
    [E, H, I], with their scales; gpt-oss's loader takes its 3-D tensors as they are); return
    :func:`load_modules_with_vllm`'s entries of the experts modules (those holding ``w13_weight``,
    or compressed-tensors' ``w13_weight_packed`` before its post-load step renames it)."""
    return {name: h for name, h in load_modules_with_vllm(export_dir, moe_backend=moe_backend,
                                                          post_load=post_load).items()
            if "w13_weight" in h or "w13_weight_packed" in h}


def _e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] fp32; element 2i is the low nibble of byte i."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(b.shape[0], -1).long()
    mag = E2M1[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def vllm_values(held: dict[str, dict[str, torch.Tensor]], module: str, scheme: str) -> torch.Tensor:
    """fp32 [N_total, K] weight implied by what vLLM holds for ``module`` (``scheme``: one of
    nvfp4, fp8_tensor, fp8_channel, mxfp8, fp8_block, mxfp4, or a layout name of SCHEME_OF_LAYOUT).

    - nvfp4 (ModelOpt and compressed-tensors alike after post-load): ``weight`` [N, K/2] E2M1 codes,
      ``weight_scale`` [N, K/16] E4M3 (unswizzled: the emulation kernel keeps the linear layout),
      ``weight_global_scale`` one fp32 for the whole fused module (ModelOpt: max of the shards'
      weight_scale_2; compressed-tensors: 1 / max of the shards' weight_global_scale).
      value = e2m1 * (float(weight_scale) * weight_global_scale), in that order — vLLM's
      ``dequantize_to_dtype`` (scale product first, then times the code).
    - fp8_tensor: ``weight`` [K, N] E4M3 (vLLM transposes it at post-load), ``weight_scale`` one fp32
      (the shards requantized to the max scale): value = float(weight).T * weight_scale.
    - fp8_channel: ``weight`` [K, N] E4M3, ``weight_scale`` [N, 1] fp32: float(weight).T * weight_scale.
    - mxfp8: ``weight`` already BF16 when the emulation kernel dequantized it at load (vLLM's own
      ``dequant_mxfp8_to_bf16``, exact for these values): float(weight); else E4M3 [N, K] with
      ``weight_scale`` [N, K/32] E8M0 bytes: float(weight) * 2^(e8m0 - 127).
    - fp8_block: ``weight`` [N, K] E4M3, ``weight_scale`` (or ``weight_scale_inv``) [ceil(N/128),
      K/128] fp32: float(weight) * scale of its 128x128 block.
    - mxfp4: ``weight`` [N, K/2] E2M1 codes (the emulation kernel keeps them packed), ``weight_scale``
      [N, K/32] E8M0 bytes: e2m1 * 2^(e8m0 - 127), computed in float64 (exact) and rounded once to fp32.
    """
    scheme = SCHEME_OF_LAYOUT.get(scheme, scheme)
    h = held[module]
    w = h["weight"]
    if scheme == "nvfp4":
        codes = _e2m1_unpack(w)
        n, k = codes.shape
        s = h["weight_scale"].view(torch.float8_e4m3fn)[:n, : k // 16].to(torch.float32)
        g = h["weight_global_scale"].to(torch.float32).reshape(())
        return (codes.reshape(n, k // 16, 16) * (s * g).unsqueeze(-1)).reshape(n, k)
    if scheme == "fp8_tensor":
        return w.to(torch.float32).t().contiguous() * h["weight_scale"].to(torch.float32).reshape(())
    if scheme == "fp8_channel":
        s = h["weight_scale"].to(torch.float32).reshape(-1, 1)
        return w.to(torch.float32).t().contiguous() * s
    if scheme == "mxfp8":
        if w.element_size() >= 2:
            return w.to(torch.float32)
        e = h["weight_scale"].view(torch.uint8).to(torch.int32)
        n, k = w.shape
        scale = torch.exp2((e[:, : k // 32] - 127).to(torch.float32))
        return (w.to(torch.float32).reshape(n, k // 32, 32) * scale.unsqueeze(-1)).reshape(n, k)
    if scheme == "mxfp4":
        codes = _e2m1_unpack(w).double()
        n, k = codes.shape
        e = h["weight_scale"].view(torch.uint8)[:n, : k // 32].double()
        return (codes.reshape(n, k // 32, 32) * torch.exp2(e - 127).unsqueeze(-1)).reshape(n, k).float()
    if scheme == "fp8_block":
        s = h["weight_scale_inv"] if "weight_scale_inv" in h else h["weight_scale"]
        s = s.to(torch.float32)
        if s.dim() == 4:
            s = s[:, 0, :, 0]
        n, k = w.shape
        full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return w.to(torch.float32) * full
    raise ValueError(f"unknown scheme {scheme!r}")
