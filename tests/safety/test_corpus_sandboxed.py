"""The hostile corpus (``corpus.HOSTILE``) replayed in child processes under hard limits.

Each case damages a copy of the golden checkpoint; then a child limited to 3.5 GiB of address
space and :data:`sandbox.CALL_TIMEOUT_S` per call runs every reader entry point on it
(``load_quantized``, on CPU and on ``meta``, ``read_protos``, ``open`` + ``get`` of every tensor,
``verify``) and ``convert`` (te-serial → te-serial, ``recipe=None``).

- ``test_refused_in_sandbox``: ``load_quantized`` raises the case's class; no entry point leaks an
  exception class that is not te-serial's, crashes or runs out of time.
- ``test_convert_refuses_like_load``: ``convert`` refuses the same checkpoints as
  ``load_quantized``, with the same error class; once on the golden checkpoint with checksums and
  once without (where the reader's header checks cannot lean on a checksum mismatch).

All selected cases are prepared up front and run in a few batches (``Sandbox.run_many``): a fork
per case would cost more than the calls.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .corpus import HOSTILE, Hostile
from .safety_helpers import Ck
from .sandbox import Call, Outcome

pytestmark = pytest.mark.sandbox

#: every case on the golden checkpoint with checksums; without them, those whose damage is not to
#: checksums or checked only by them
CONVERT_CASES = [pytest.param(h, sums, id=f"{h.id}-{'checksums' if sums else 'no-checksums'}", marks=h.marks)
                 for sums in (True, False) for h in HOSTILE
                 if sums or not (h.needs_checksums or h.verify)]


def _calls(case: Hostile, sums: bool, path: Path, out: Path) -> dict[str, Call]:
    p = str(path)
    calls = {"load": Call("load", [p], {"verify": case.verify}),
             "load-meta": Call("load", [p], {"device": "meta"}),
             "read_protos": Call("read_protos", [p]),
             "open": Call("open", [p])}
    if sums:
        calls["verify"] = Call("verify", [p])
    calls["convert"] = Call("convert", [p, str(out)])
    return calls


@pytest.fixture(scope="module")
def outcomes(request, golden, golden_nosums, sandbox, tmp_path_factory) -> dict:
    """(case id, with checksums) → entry point → Outcome, for every case this session selected."""
    wanted: dict[tuple[str, bool], Hostile] = {}
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec"):
            params = item.callspec.params
            case = params["case"]
            wanted[(case.id, params.get("sums", True))] = case
    root = tmp_path_factory.mktemp("sandboxed")
    keys, jobs = [], []
    for k, ((cid, sums), case) in enumerate(wanted.items()):
        src = golden if sums else golden_nosums
        work = root / str(k)
        work.mkdir()
        if case.form == "dir":
            path = Path(shutil.copytree(src / "ckpt", work / "ckpt"))
        else:
            path = Path(shutil.copy(src / "one.safetensors", work / "one.safetensors"))
        case.damage(Ck(path))
        calls = _calls(case, sums, path, work / "converted")
        keys.append(((cid, sums), list(calls)))
        jobs.append(list(calls.values()))
    return {key: dict(zip(names, outs)) for (key, names), outs in zip(keys, sandbox.run_many(jobs))}


@pytest.mark.parametrize("case", [h.param() for h in HOSTILE])
def test_refused_in_sandbox(case, outcomes):
    out: dict[str, Outcome] = outcomes[(case.id, True)]
    problems = [p for name, o in out.items() if name != "convert" and (p := o.problem())]
    assert not problems, "\n".join(problems)
    load = out["load"]
    assert load.status == "raised", f"loaded: {case.id} must be refused with {case.exc.__name__}"
    assert case.exc.__name__ in load.mro, f"want {case.exc.__name__}, got {load.describe()}"


@pytest.mark.parametrize("case, sums", CONVERT_CASES)
def test_convert_refuses_like_load(case, sums, outcomes):
    out: dict[str, Outcome] = outcomes[(case.id, sums)]
    load, conv = out["load"], out["convert"]
    assert load.status == "raised" and load.checkpoint_error, \
        f"load_quantized does not refuse it: {load.describe()}"
    assert conv.problem() is None, conv.problem()
    assert conv.status == "raised", f"convert accepted what load_quantized refuses ({load.describe()})"
    assert conv.exc == load.exc, f"convert raised {conv.describe()}\nload_quantized {load.describe()}"
