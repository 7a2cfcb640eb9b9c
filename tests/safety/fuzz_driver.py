"""Coverage-guided fuzzing of te-serial's readers, one target per process (run by test_fuzz.py).

    python fuzz_driver.py CONFIG.json

CONFIG names the target, the seed files, a work directory, a time budget and the engine:
``atheris`` (libFuzzer's coverage-guided mutation of te-serial's instrumented bytecode) or
``hypothesis`` (random structured mutations of the seeds, where atheris is not installed).

Targets (each input is written to disk, then ``load_quantized(..., verify=True)`` reads it):

- ``file``: a whole single-file checkpoint (``.safetensors`` with the manifest in its header);
- ``manifest``: the raw bytes of ``te_serial.msgpack`` in a directory that holds the shards of
  every seed checkpoint;
- ``header``: a shard's safetensors JSON header; the input's first byte picks the shard, the rest
  is the header, written before the shard's original data (the manifest's file size is kept in
  step, so the header itself is parsed).

A manifest that still ends with its checksum field (format 1.1) is sealed again after mutation,
as an attacker would, so mutations reach the checks behind the checksum.

The process runs under RLIMIT_AS (3.5 GiB by default) and a per-input time limit. Every input
must load or raise a ``te_serial.TeSerialError``. Anything else is a finding: one JSON line per
distinct (exception class, raising location) in ``findings.jsonl`` with the input saved beside
it; an input that runs out of time or kills the process is left by libFuzzer as
``timeout-*`` / ``crash-*`` / ``oom-*`` (atheris) or as ``current.bin`` (hypothesis), and
reported by the parent.
"""

from __future__ import annotations

import hashlib
import json
import random
import resource
import signal
import struct
import sys
import time
import traceback
from pathlib import Path


class Hang(BaseException):
    """SIGALRM: one input ran past its time limit (hypothesis engine)."""


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    limit = int(cfg.get("as_limit", int(3.5 * 2**30)))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    work = Path(cfg["work"])
    findings_dir = work / "findings"
    findings_dir.mkdir(parents=True, exist_ok=True)
    findings_log = open(work / "findings.jsonl", "a")
    seen: dict[str, int] = {}

    engine = cfg.get("engine", "auto")
    atheris = None
    if engine in ("auto", "atheris"):
        try:
            import atheris  # noqa: F811
        except ImportError:
            if engine == "atheris":
                raise
    engine = "atheris" if atheris is not None else "hypothesis"

    import torch
    torch.set_num_threads(1)
    if atheris is not None:
        with atheris.instrument_imports(include=["te_serial"]):
            import te_serial
            from te_serial.checkpoint import tree as tree_mod
    else:
        import te_serial
        from te_serial.checkpoint import tree as tree_mod

    import fuzz_mutators  # beside this file
    from te_serial.checkpoint import manifest as manifest_mod
    fuzz_mutators.HEADER_KEY = manifest_mod.HEADER_KEY
    pack_manifest = getattr(manifest_mod, "seal", tree_mod.pack)  # format 1.1 seals its manifest

    target = cfg["target"]
    seeds = [Path(p).read_bytes() for p in cfg["seeds"]]
    run_dir = work / "run"
    run_dir.mkdir(exist_ok=True)

    # ---- the targets ---------------------------------------------------------------------
    if target == "file":
        path = run_dir / "fuzz.safetensors"

        def prepare(data: bytes):
            path.write_bytes(fuzz_mutators.reseal_single_file(data))
            return path
    elif target == "manifest":
        mdir = Path(cfg["manifest_dir"])

        def prepare(data: bytes):
            (mdir / "te_serial.msgpack").write_bytes(fuzz_mutators.reseal(data))
            return mdir
    elif target == "header":
        shards = []  # (checkpoint dir, shard name, data section, manifest doc, file index)
        for ck, name in cfg["shards"]:
            raw = (Path(ck) / name).read_bytes()
            n = struct.unpack("<Q", raw[:8])[0]
            doc = tree_mod.unpack((Path(ck) / "te_serial.msgpack").read_bytes())
            j = [f["name"] for f in doc["files"]].index(name)
            shards.append((Path(ck), name, raw[8 + n:], doc, j))

        def prepare(data: bytes):
            ck, name, body, doc, j = shards[data[0] % len(shards)] if data else shards[0]
            header = data[1:]
            blob = struct.pack("<Q", len(header)) + header + body
            (ck / name).write_bytes(blob)
            doc["files"][j]["size"] = len(blob)
            (ck / "te_serial.msgpack").write_bytes(pack_manifest(doc))
            return ck
    else:
        raise SystemExit(f"unknown target {target!r}")

    def record(kind: str, exc_name: str, message: str, tb: str, where: str, data: bytes) -> None:
        sig = f"{kind}:{exc_name}@{where}"
        seen[sig] = seen.get(sig, 0) + 1
        if seen[sig] > 1:
            return
        h = hashlib.sha1(sig.encode()).hexdigest()[:12]
        inp = findings_dir / f"{h}.bin"
        inp.write_bytes(data)
        findings_log.write(json.dumps({"target": target, "signature": sig, "kind": kind, "exc": exc_name,
                                       "message": message[:1000], "where": where, "traceback": tb[-4000:],
                                       "input": str(inp), "size": len(data)}) + "\n")
        findings_log.flush()

    per_input = float(cfg.get("per_input_s", 10))
    execs = [0]

    def one_input(data: bytes) -> None:
        execs[0] += 1
        try:
            p = prepare(data)
            te_serial.load_quantized(p, verify=True)
        except te_serial.TeSerialError:
            pass
        except Hang:
            record("timeout", "Hang", f"over {per_input} s", "", "-", data)
        except BaseException as e:  # noqa: BLE001 - every other class is a finding
            frames = traceback.extract_tb(e.__traceback__)
            ours = [f for f in frames if "te_serial" in f.filename] or frames
            where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"
            try:
                msg = str(e)
            except BaseException:  # noqa: BLE001
                msg = "<str() failed>"
            record("exception", f"{type(e).__module__}.{type(e).__qualname__}", msg,
                   "".join(traceback.format_exception(e)), where, data)

    seconds = float(cfg["seconds"])
    stats = {"engine": engine, "target": target, "seconds": seconds}
    if engine == "atheris":
        corpus = work / "corpus"
        corpus.mkdir(exist_ok=True)
        for i, s in enumerate(seeds):
            (corpus / f"seed-{i}").write_bytes(s)
        max_len = int(max(len(s) for s in seeds) * 1.25) + 64
        argv = [sys.argv[0], str(corpus), f"-max_total_time={int(seconds)}", f"-timeout={int(per_input)}",
                f"-rss_limit_mb={limit >> 20}", f"-max_len={max_len}", f"-seed={cfg.get('seed', 1)}",
                f"-artifact_prefix={work}/", "-print_final_stats=1"]
        (work / "stats.json").write_text(json.dumps(stats))

        def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
            rng = random.Random(seed)
            if rng.random() < 0.5:  # half structural (decode, edit a node, encode), half libFuzzer's
                try:
                    new = fuzz_mutators.mutate(target, data, rng)
                except Exception:  # noqa: BLE001 - a mutator bug must not end the run
                    new = None
                if new is not None and len(new) <= max_size:
                    return new
            return atheris.Mutate(data, max_size)

        atheris.Setup(argv, one_input, custom_mutator=custom_mutator)
        atheris.Fuzz()  # exits the process at the end of the budget
        return

    # ---- hypothesis: structured mutations of the seeds -------------------------------------
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    def on_alarm(signum, frame):
        raise Hang()

    signal.signal(signal.SIGALRM, on_alarm)
    current = work / "current.bin"
    hostile = [b"\xff" * 8, b"\x00" * 8, struct.pack("<Q", 2**63), b"\xdd\xff\xff\xff\xff",
               b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x02", b"\x91" * 32,
               b"\xd4\x02\x91", b'"data_offsets":[0,99999999999]', b"[[[[[[[[", b"\xc1", b"1e400", b"-1",
               b'"shape":[4294967296,4294967296]', b"\xd6\xff\xff\xff\xff\xff"]

    @st.composite
    def mutated(draw):
        data = bytearray(draw(st.sampled_from(seeds)))
        for _ in range(draw(st.integers(1, 6))):
            if not data:
                break
            pos = draw(st.integers(0, len(data) - 1))
            op = draw(st.sampled_from(["structural", "structural", "xor", "truncate", "insert", "delete",
                                       "overwrite"]))
            if op == "structural":
                try:
                    new = fuzz_mutators.mutate(target, bytes(data), random.Random(draw(st.integers(0, 2**32))))
                except Exception:  # noqa: BLE001
                    new = None
                if new is not None:
                    data = bytearray(new)
            elif op == "xor":
                data[pos] ^= draw(st.integers(1, 255))
            elif op == "truncate":
                del data[pos:]
            elif op == "insert":
                data[pos:pos] = draw(st.one_of(st.binary(min_size=1, max_size=16), st.sampled_from(hostile)))
            elif op == "delete":
                del data[pos:pos + draw(st.integers(1, 64))]
            else:
                arg = draw(st.sampled_from(hostile))
                data[pos:pos + len(arg)] = arg
        return bytes(data)

    deadline = time.monotonic() + seconds

    def body(data):
        if time.monotonic() > deadline:
            return
        current.write_bytes(data)
        signal.setitimer(signal.ITIMER_REAL, per_input)
        try:
            one_input(data)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    rounds = 0
    while time.monotonic() < deadline:  # reproducible: round k draws from seed (seed, k)
        run = settings(max_examples=100, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))(given(data=mutated())(body))
        hseed(int(cfg.get("seed", 1)) * 1_000_003 + rounds)(run)()
        rounds += 1
    stats["execs"] = execs[0]
    (work / "stats.json").write_text(json.dumps(stats))
    current.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
