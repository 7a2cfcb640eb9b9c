"""Every registered quantizer kind appears in every per-format table: the shared test cases, the
slice rules, the TE adapters and the recipe list, and implements the format protocol.

A new format module that registers a kind fails here until it is wired in everywhere (README,
"Adding a format").
"""

from __future__ import annotations

import pytest
import torch

import te_serial as ts
from te_serial import formats as tsf
from helpers import FORMAT_CASES
from te_serial.formats import COLUMNWISE, QUANTIZER_REGISTRY, ROWWISE, UsageLayout
from te_serial.formats.te_adapter import TE_ADAPTERS
from te_serial.recipes import RECIPES, recipe_quantizer
from test_slicing import CASES as SLICE_CASES
from test_slicing import SLICE_RULES

#: the formats (a grouped tensor is a container of members of these: tests/test_grouped.py)
KINDS = sorted(k for k, cls in QUANTIZER_REGISTRY.items() if cls is not tsf.GroupedQuantizer)


def test_registry_holds_the_five_quantizers():
    assert {QUANTIZER_REGISTRY[k].__name__ for k in KINDS} >= {
        "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer", "Float8BlockQuantizer",
        "NVFP4Quantizer"}


def test_every_kind_has_test_cases():
    assert set(KINDS) <= {make(True, True).kind for make, _ in FORMAT_CASES}
    assert set(KINDS) <= {make(True, True).kind for make, *_ in SLICE_CASES}


def test_every_kind_has_a_slice_rule():
    assert set(KINDS) <= set(SLICE_RULES)


def test_every_kind_with_a_te_class_has_a_te_adapter():
    for kind in KINDS:
        cls = QUANTIZER_REGISTRY[kind]
        adapter = cls.te_adapter
        if not cls.has_te_class:  # MXFP4: TE 2.20 has no tensor class; nothing may need an adapter
            assert adapter is None, kind
            continue
        assert adapter is not None, kind
        assert TE_ADAPTERS[adapter.te_tensor] is adapter and TE_ADAPTERS[adapter.te_storage] is adapter, kind


def test_every_kind_has_a_recipe():
    assert set(KINDS) <= {recipe_quantizer(name).kind for name in RECIPES}


@pytest.mark.parametrize("make,shape", FORMAT_CASES, ids=[m(True, True).layout_name() for m, _ in FORMAT_CASES])
def test_every_case_implements_the_protocol(make, shape):
    q = make(True, True)
    specs = q.describe_buffers(shape)
    for usage in (ROWWISE, COLUMNWISE):
        lay = q.usage_layout(usage)
        assert isinstance(lay, UsageLayout)
        assert {lay.data, lay.scale} | ({lay.amax} if lay.amax else set()) <= set(specs), usage
    for name, (r, c) in q.valid_regions(shape).items():
        rows, cols = specs[name].shape
        assert r <= rows and c <= cols, name
    assert q.layout_key() == make(False, True).layout_key()  # usages are not layout
    assert isinstance(q.layout_name(), str) and q.layout_name()
    t = q(torch.randn(shape))
    for usage in q.usages_on():
        assert q.exact_output(q) == q and q.derivable(q, usage)
        got = q.derive(t.buffers(), shape, q, usage)
        for n, b in got.items():
            assert torch.equal(b.view(torch.uint8), t.buffers()[n].view(torch.uint8)), n
    assert ts.slice_quantized(t).buffers().keys() == t.buffers().keys()
