"""TensorProto.create_tensor traces under torch.compile(fullgraph=True) with no graph break."""

from __future__ import annotations

import pytest
import torch

import te_serial as ts
from helpers import same_bits

QUANTIZERS = [
    ts.Float8CurrentScalingQuantizer(),
    ts.MXFP8Quantizer(),
    ts.MXFP8Quantizer(with_2d_quantization=True, columnwise=False),
    ts.Float8BlockQuantizer(block_scaling_dim=1),
    ts.Float8BlockQuantizer(block_scaling_dim=2),
    ts.NVFP4Quantizer(),
    ts.NVFP4Quantizer(with_2d_quantization=True, rowwise=False),
]
IDS = [f"{q.kind}{'-2d' if getattr(q, 'with_2d_quantization', False) or getattr(q, 'block_scaling_dim', 0) == 2 else ''}" for q in QUANTIZERS]
BACKENDS = ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(fn, backend):
    return torch.compile(fn, backend=backend, fullgraph=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q", QUANTIZERS, ids=IDS)
def test_create_tensor_returned_from_compiled_fn(q, backend):
    proto = ts.TensorProto((64, 128), torch.bfloat16, q, requires_grad=False)

    def make():
        return proto.create_tensor()

    out = _compile(make, backend)()
    assert type(out) is q.tensor_class and out.shape == (64, 128) and out.dtype == torch.bfloat16
    assert out.quantizer == q
    assert {n: (tuple(b.shape), b.dtype) for n, b in out.buffers().items()} == \
        {n: tuple(s) for n, s in proto.buffer_specs().items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q", QUANTIZERS, ids=IDS)
def test_create_fill_and_dequantize_inside_compiled_fn(q, backend):
    ref = q(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))
    proto = ts.to_tensor_proto(ref)
    names = proto.inner_names()

    def load_and_use(x, *buffers):
        t = proto.create_tensor()
        for name, b in zip(names, buffers):
            getattr(t, name).copy_(b)
        return x + t.dequantize(torch.float32)

    x = torch.randn(64, 128)
    got = _compile(load_and_use, backend)(x, *ref.buffers().values())
    assert same_bits(got, x + ref.dequantize(torch.float32))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_assemble_from_inputs_and_linear(backend):
    q = ts.MXFP8Quantizer(columnwise=False)
    w = q(torch.randn(64, 128))
    proto = ts.to_tensor_proto(w)

    def fwd(x, *buffers):
        weight = proto.assemble(list(buffers))
        return torch.nn.functional.linear(x, weight.dequantize(torch.float32))

    x = torch.randn(8, 128)
    got = _compile(fwd, backend)(x, *w.buffers().values())
    assert torch.allclose(got, x @ w.dequantize(torch.float32).t(), atol=1e-5)


def test_plain_proto_compiles_too():
    proto = ts.TensorProto((4, 5), torch.float16)
    out = _compile(lambda: proto.create_tensor().fill_(1), "aot_eager")()
    assert out.dtype == torch.float16 and out.shape == (4, 5) and bool((out == 1).all())
