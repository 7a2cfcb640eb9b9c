"""Ask SGLang's own config code which quantization a te-serial serving export gets, on CPU.

``sglang_quant_config(export_dir)`` builds SGLang's quant config exactly as SGLang's model loader
does: ``sglang.srt.configs.model_config.ModelConfig(export_dir)`` (its ``_verify_quantization``
detects the method — ``modelopt_fp8`` / ``modelopt_fp4`` / ``mxfp8`` / ``compressed-tensors`` —
from ``config.json``'s ``quantization_config`` or ``hf_quant_config.json``), then
``sglang.srt.model_loader.loader._get_quantization_config(model_config, LoadConfig())`` (what
``DefaultModelLoader`` calls: the model class's ``packed_modules_mapping``, then
``weight_utils.get_quant_config`` → ``<QuantConfig>.from_config``).

``sglang_quant_method(quant_config, prefix, is_linear=True)`` returns the quant method SGLang
gives that layer, by the call SGLang's layers make in their constructors,
``quant_config.get_quant_method(layer, prefix=prefix)`` (``LinearBase.__init__``,
``VocabParallelEmbedding.__init__``), on a real SGLang layer object built unquantized on one rank:

* ``is_linear=True`` and the last name component ``lm_head``: ``ParallelLMHead`` (as SGLang's
  ``LlamaForCausalLM`` builds it);
* ``is_linear=True`` otherwise: ``LinearBase`` (the class every ``*ParallelLinear`` derives from,
  and the one ``get_quant_method`` tests with ``isinstance``);
* ``is_linear=False``: ``VocabParallelEmbedding`` (``model.embed_tokens``).

``None`` is mapped the way the layer constructors map it (``UnquantizedEmbeddingMethod``).
``sglang_is_quantized(...)`` is ``False`` for SGLang's ``UnquantizedLinearMethod`` /
``UnquantizedEmbeddingMethod``, ``True`` for any other method.

Tested with SGLang 0.5.23 installed ``--no-deps`` next to torch 2.13.0+cpu, plus the packages in
``requirements.txt`` (see that file).

Stubs (everything else is SGLang's own code), active only inside this module's calls
(``_sglang_env``), removed again afterwards so the rest of the test process sees neither:

1. ``triton`` (a large GPU compiler wheel, not in the requirements; SGLang's
   ``sglang.srt.utils.common`` imports it at module level, kernels are ``@triton.jit`` at import;
   stubbed only when not installed): SGLang's own macOS stub
   (``sglang/_platform_stubs.py``: ``_MockModule``, ``_TritonFinder``-style meta-path finder,
   ``_Config``, ``_cdiv``, ``_next_power_of_2``, ``_triton_key``), wired as its
   ``install_platform_stubs`` wires it. That function itself is not called: it only acts on
   macOS/arm64 with MPS and also patches ``torch.mps`` and ``Tensor.to``/``copy_``. The file is
   loaded by path, because importing ``sglang`` (its ``__init__``) already needs ``triton``.
2. ``torchvision`` (the PyPI wheel is a CUDA build whose ops fail to register on a CPU torch:
   ``operator torchvision::nms does not exist``; SGLang's ``sglang.srt.configs`` package imports
   ``torchvision.transforms`` at module level for InternVL / DeepSeek-OCR image helpers, never
   called here): the same ``_MockModule`` for ``torchvision.*``. Before it goes in, the
   transformers modules that test ``is_torchvision_available()`` at import
   (``image_utils``, ``image_processing_utils``, ``image_processing_backends``,
   ``video_processing_utils``) are imported with the real answer (absent), and torch's cached
   ``has_triton_package()`` / ``has_triton()`` are evaluated first, so neither transformers nor
   torch caches the stubs' presence.
3. ``torch.cuda.get_device_capability`` answers ``capability`` (default ``(10, 0)``, an SM100
   GPU) during ``sglang_quant_method``: SGLang's compressed-tensors scheme selection
   (``CompressedTensorsConfig._check_scheme_supported``) asks it to choose between e.g. W8A8 and
   W8A16 FP8 and raises on a CPU-only torch. It changes which quantized scheme is picked, never
   whether a layer is quantized (too low a capability makes SGLang raise instead). The ModelOpt
   configs do not call it.
4. ``vllm`` is hidden (``sys.modules["vllm"] = None``, so ``import vllm`` raises ImportError):
   SGLang does not depend on vLLM and imports it only optionally
   (``sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py``: ``try: from vllm import
   _custom_ops`` ... ``except ImportError``), which is SGLang's path without vLLM. When vLLM is
   installed for the vLLM consumer tests, importing it here would resolve vLLM's
   ``current_platform`` (to ``UnspecifiedPlatform``) before ``vllm_harness`` sets
   ``VLLM_TARGET_DEVICE=cpu``, breaking those tests in the same process.

No CUDA kernel package is stubbed: SGLang imports ``sgl_kernel`` / ``flashinfer`` /
``deep_gemm`` only behind its platform checks (``is_cuda()`` is False on CPU) or ``try``. Side
effects of importing SGLang that stay (SGLang's, not ours):
``sglang.srt.utils.hf_transformers_patches.apply_all()`` patches a few transformers internals,
and ``redirect_third_party_caches()`` ``setdefault``s cache-directory environment variables.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

_STUB_ROOTS = ("triton", "torchvision")
_state: dict = {}


def _load_sglang_platform_stubs() -> types.ModuleType:
    """SGLang's ``sglang/_platform_stubs.py``, loaded by file path (``import sglang`` needs triton)."""
    name = "_sglang_platform_stubs_for_tests"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "_platform_stubs.py")
    mspec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(mspec)
    sys.modules[name] = module  # dataclasses in it look their module up in sys.modules
    mspec.loader.exec_module(module)
    return module


def _build_stub_modules() -> dict[str, types.ModuleType]:
    """The stub modules, wired as ``install_platform_stubs`` wires its triton stub."""
    ps = _load_sglang_platform_stubs()
    mods: dict[str, types.ModuleType] = {}

    def mock(name: str):
        m = ps._MockModule(name)
        mods[name] = m
        return m

    triton = mock("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv = ps._cdiv
    triton.next_power_of_2 = ps._next_power_of_2
    triton.Config = ps._Config
    tl = mock("triton.language")

    class _constexpr:
        def __init__(self, value=None):
            self.value = value

    tl.constexpr = _constexpr
    triton.language = tl
    extra = mock("triton.language.extra")
    tl.extra = extra
    extra.libdevice = mock("triton.language.extra.libdevice")
    runtime = mock("triton.runtime")
    triton.runtime = runtime
    jit_mod = mock("triton.runtime.jit")

    class _JITFunction:
        pass

    class _KernelInterface(ps._StubBase):
        pass

    jit_mod.JITFunction = _JITFunction
    jit_mod.KernelInterface = _KernelInterface
    runtime.jit = jit_mod
    cache_mod = mock("triton.runtime.cache")
    cache_mod.triton_key = ps._triton_key
    runtime.cache = cache_mod
    autotuner = mock("triton.runtime.autotuner")

    class _OutOfResources(Exception):
        pass

    class _PTXASError(Exception):
        pass

    autotuner.OutOfResources = _OutOfResources
    autotuner.PTXASError = _PTXASError
    runtime.autotuner = autotuner
    compiler_root = mock("triton.compiler")

    class _CompiledKernel(ps._StubBase):
        pass

    compiler_root.CompiledKernel = _CompiledKernel
    compiler_impl = mock("triton.compiler.compiler")

    class _ASTSource(ps._StubBase):
        pass

    compiler_impl.ASTSource = _ASTSource
    compiler_impl.triton_key = ps._triton_key
    compiler_root.compiler = compiler_impl
    triton.compiler = compiler_root
    runtime.driver = mock("triton.runtime.driver")
    triton.testing = mock("triton.testing")
    tools = mock("triton.tools")
    triton.tools = tools
    tools.tensor_descriptor = mock("triton.tools.tensor_descriptor")
    backends = mock("triton.backends")
    triton.backends = backends
    compiler = mock("triton.backends.compiler")

    class _GPUTarget(ps._StubBase):
        pass

    compiler.GPUTarget = _GPUTarget
    backends.compiler = compiler

    mock("torchvision")
    return mods


class _StubFinder:
    """Meta-path finder (as SGLang's ``_TritonFinder``) for any other ``triton.*`` /
    ``torchvision.*`` submodule: a ``_MockModule``, remembered so it can be removed again."""

    def __init__(self, ps, mods, roots):
        self._ps = ps
        self._mods = mods
        self._roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in self._roots:
            return None
        if fullname in sys.modules:
            return getattr(sys.modules[fullname], "__spec__", None)
        mod = self._ps._MockModule(fullname)
        self._mods[fullname] = mod
        sys.modules[fullname] = mod
        parent, _, child = fullname.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)
        return mod.__spec__


def _prewarm_real_answers() -> None:
    """Let transformers and torch record that torchvision / triton are absent before the stubs."""
    for name in (
        "transformers.image_utils",
        "transformers.image_processing_utils",
        "transformers.image_processing_backends",
        "transformers.video_processing_utils",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()
    with contextlib.suppress(Exception):
        torch_triton.has_triton()


@contextlib.contextmanager
def _sglang_env():
    """Stubs in (see the module docstring), then out again, restoring what was there."""
    if "mods" not in _state:
        # only what is not installed is stubbed (an installed triton is SGLang's to use)
        roots = tuple(r for r in _STUB_ROOTS if importlib.util.find_spec(r) is None)
        _prewarm_real_answers()
        ps = _load_sglang_platform_stubs()
        mods = {n: m for n, m in _build_stub_modules().items() if n.split(".")[0] in roots}
        _state.update(mods=mods, finder=_StubFinder(ps, mods, roots))
    mods, finder = _state["mods"], _state["finder"]
    saved = {name: sys.modules.get(name) for name in mods}
    had_vllm, vllm = "vllm" in sys.modules, sys.modules.get("vllm")
    sys.modules.update(mods)
    sys.modules["vllm"] = None  # `import vllm` raises ImportError (stub 4)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if had_vllm:
            sys.modules["vllm"] = vllm
        else:
            sys.modules.pop("vllm", None)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        for name in list(mods):  # the finder may have added some
            if sys.modules.get(name) is mods[name]:
                prev = saved.get(name)
                if prev is None:
                    del sys.modules[name]
                else:
                    sys.modules[name] = prev


def sglang_modules() -> types.SimpleNamespace:
    """The SGLang modules this harness uses (imported once, under the stubs)."""
    if "sg" not in _state:
        with _sglang_env():
            from sglang.srt.configs.load_config import LoadConfig
            from sglang.srt.configs.model_config import ModelConfig
            from sglang.srt.layers.linear import LinearBase
            from sglang.srt.layers.quantization.unquant import (
                UnquantizedEmbeddingMethod,
                UnquantizedLinearMethod,
            )
            from sglang.srt.layers.vocab_parallel_embedding import (
                ParallelLMHead,
                VocabParallelEmbedding,
            )
            from sglang.srt.model_loader import loader
            from sglang.version import __version__

            _state["sg"] = types.SimpleNamespace(
                LoadConfig=LoadConfig,
                ModelConfig=ModelConfig,
                LinearBase=LinearBase,
                ParallelLMHead=ParallelLMHead,
                VocabParallelEmbedding=VocabParallelEmbedding,
                UnquantizedLinearMethod=UnquantizedLinearMethod,
                UnquantizedEmbeddingMethod=UnquantizedEmbeddingMethod,
                loader=loader,
                version=__version__,
            )
    return _state["sg"]


def sglang_model_config(export_dir):
    """SGLang's ``ModelConfig`` for the export (``.quantization`` is the method SGLang detected)."""
    sg = sglang_modules()
    with _sglang_env():
        return sg.ModelConfig(str(Path(export_dir)))


def sglang_quant_config(export_dir, model_config=None):
    """SGLang's quant config object for the export, built as SGLang's model loader builds it."""
    sg = sglang_modules()
    if model_config is None:
        model_config = sglang_model_config(export_dir)
    with _sglang_env():
        return sg.loader._get_quantization_config(model_config, sg.LoadConfig())


@contextlib.contextmanager
def _device_capability(capability):
    original = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: tuple(capability)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = original


def _layer(prefix: str, is_linear: bool, hidden: int = 256, vocab: int = 128):
    sg = sglang_modules()
    if not is_linear:
        return sg.VocabParallelEmbedding(vocab, hidden, params_dtype=torch.bfloat16, enable_tp=False)
    if prefix.rsplit(".", 1)[-1] == "lm_head":
        return sg.ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16, enable_tp=False)
    return sg.LinearBase(hidden, hidden, params_dtype=torch.bfloat16)


def _quant_method_and_layer(quant_config, layer_prefix, is_linear, capability):
    sg = sglang_modules()
    layer = _layer(layer_prefix, is_linear)
    with _sglang_env(), _device_capability(capability):
        method = quant_config.get_quant_method(layer, prefix=layer_prefix)
    if method is None and isinstance(layer, sg.VocabParallelEmbedding):
        # VocabParallelEmbedding.__init__ (ParallelLMHead's too): None -> UnquantizedEmbeddingMethod
        method = sg.UnquantizedEmbeddingMethod()
    return method, layer


def sglang_quant_method(quant_config, layer_prefix: str, is_linear: bool = True, capability=(10, 0)):
    """The quant method SGLang gives layer ``layer_prefix`` (see the module docstring)."""
    return _quant_method_and_layer(quant_config, layer_prefix, is_linear, capability)[0]


def sglang_layer_scheme(quant_config, layer_prefix: str, is_linear: bool = True, capability=(10, 0)):
    """The per-layer scheme ``get_quant_method`` attaches (compressed-tensors: e.g.
    ``CompressedTensorsW8A16Fp8``), or ``None``."""
    return _quant_method_and_layer(quant_config, layer_prefix, is_linear, capability)[1].scheme


def sglang_is_quantized(quant_config, layer_prefix: str, is_linear: bool = True, capability=(10, 0)) -> bool:
    """Whether SGLang would load ``layer_prefix`` with a quantized method."""
    sg = sglang_modules()
    method = sglang_quant_method(quant_config, layer_prefix, is_linear, capability)
    if method is None:
        raise AssertionError(f"SGLang returned no quant method for linear layer {layer_prefix!r}")
    return not isinstance(method, (sg.UnquantizedLinearMethod, sg.UnquantizedEmbeddingMethod))


def sglang_load_linear(quant_config, layer_prefix: str, tensors: dict, capability=(10, 0)):
    """A SGLang linear layer (``LinearBase``, 256×256) holding ``tensors`` (its parameter name →
    the export's tensor) as SGLang loads them: the quant method's ``create_weights`` makes the
    parameters, each parameter's own loader (``load_column_parallel_weight``, one rank) copies the
    export's tensor in, then the method's ``process_weights_after_loading`` runs."""
    method, layer = _quant_method_and_layer(quant_config, layer_prefix, True, capability)
    n, k = layer.output_size, layer.input_size
    with _sglang_env(), _device_capability(capability):
        method.create_weights(layer, input_size_per_partition=k, output_partition_sizes=[n], input_size=k,
                              output_size=n, params_dtype=torch.bfloat16, weight_loader=None)
        params = dict(layer.named_parameters())
        for name, t in tensors.items():
            params[name].load_column_parallel_weight(t, tp_rank=0)
        method.process_weights_after_loading(layer)
    return layer
