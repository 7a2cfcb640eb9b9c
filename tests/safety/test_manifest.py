"""Malformed manifests (invariants, names, versions, file lists, aliases, the tree) are refused
with the right CheckpointError naming the manifest and field; newer minor versions still load."""

from __future__ import annotations

import pytest

import te_serial
from te_serial.errors import ManifestError, VersionError

from .corpus import FOUND_AT_FIRST_READ, MANIFEST_CASES
from .safety_helpers import P, T, Ck, _pbuf, _pi, _proto, _quant, assert_same_state, bounded, expect_error


def test_helpers_round_trip(ck, state):
    """Re-writing an unchanged manifest with these helpers keeps the checkpoint loadable, bit-exact."""
    ck.write(ck.doc())
    assert_same_state(ck.load(verify=True), state)
    assert te_serial.verify(ck.path) > 0


@pytest.mark.parametrize("mutate, exc, form", MANIFEST_CASES)
def test_manifest_edit_is_refused(mutate, exc, form, request):
    ck = Ck(request.getfixturevalue("ckpt_dir" if form == "dir" else "ckpt_file"))
    doc = ck.doc()
    needles = mutate(doc, ck)
    ck.write(doc)
    expect_error(ck.load, exc, *needles, peak=ck.peak)
    if request.node.callspec.id in FOUND_AT_FIRST_READ:  # the checksums column: decoded at first use
        te_serial.open(ck.path).close()
        assert set(te_serial.read_protos(ck.path)) == set(doc["tensors"]["names"])  # by design (open speed)
        expect_error(lambda: te_serial.verify(ck.path), exc, *needles, peak=ck.peak)
        with pytest.raises(exc) as info:
            te_serial.read_protos(ck.path, verify=True)
        assert info.value.field == "tensors/checksums" and all(str(n) in str(info.value) for n in needles), info.value
    elif exc is ManifestError or exc is VersionError:  # found from the manifest alone
        expect_error(lambda: te_serial.read_protos(ck.path), exc, *needles, peak=ck.peak)
        expect_error(lambda: te_serial.open(ck.path), exc, *needles, peak=ck.peak)


def test_quantizer_kind_from_the_future_is_skipped_when_not_strict(ck, state):
    """load_quantized's docstring: strict=False skips a tensor whose quantizer kind a newer
    te-serial wrote, instead of failing; the rest loads bit-exactly."""
    ck.edit(lambda d: _quant(d).update(kind="fp8_from_the_future"))
    expect_error(ck.load, ManifestError, ck.source, "fp8_from_the_future", peak=ck.peak)
    with bounded(peak=ck.peak):
        out = ck.load(strict=False, verify=True)
    assert T not in out
    want = dict(state)
    del want[T]
    assert_same_state(out, want)


@pytest.mark.parametrize("tensor", [P, T])
def test_a_damaged_prototype_is_refused_by_a_non_strict_load(ck, tensor):
    """strict=False skips only tensors whose quantizer a newer te-serial wrote: a prototype whose
    shape needs more bytes than the checkpoint's files hold (a plain tensor's declared buffer; a
    quantized tensor's shape, its buffers left as they were) is refused by every read, strict or
    not, on CPU and on meta, naming the tensor and the field."""
    doc = ck.doc()
    if tensor == P:
        _proto(doc, P)["shape"] = _pbuf(doc, P, "data")["shape"] = [1 << 40, 1 << 20]
        field = f"protos/{_pi(doc, P)}/buffers/0/shape"
    else:
        _proto(doc, T)["shape"] = [1 << 40, 1 << 20]
        field = f"protos/{_pi(doc, T)}"
    ck.write(doc)
    for read in (lambda: ck.load(strict=False), lambda: ck.load(strict=False, device="meta"), ck.load,
                 lambda: te_serial.open(ck.path, strict=False), lambda: te_serial.read_protos(ck.path)):
        with pytest.raises(ManifestError) as info:
            read()
        assert info.value.tensor == tensor and info.value.field == field, info.value


@pytest.mark.parametrize("where", ["top", "producer", "tensor-column", "proto", "buffer", "file"])
def test_newer_minor_version_with_unknown_optional_field_loads(ck, state, where):
    def edit(doc):
        doc["version"] = [1, 9]
        extra = {"added_in": "1.9", "values": [1, 2.5, None, True]}
        if where == "top":
            doc["future_field"] = extra
        elif where == "producer":
            doc["producer"]["future_tool"] = "x"
        elif where == "tensor-column":
            doc["tensors"]["future_column"] = [1] * len(doc["tensors"]["names"])
        elif where == "proto":
            _proto(doc)["future_field"] = extra
        elif where == "buffer":
            _pbuf(doc)["future_field"] = 7
        elif ck.is_dir:
            doc["files"][0]["future_field"] = "x"
    ck.edit(edit)
    assert_same_state(ck.load(verify=True), state)
    assert te_serial.verify(ck.path) > 0
