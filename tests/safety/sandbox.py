"""Runs te-serial calls on hostile inputs in child processes under hard limits.

:class:`Sandbox` starts worker processes (fresh interpreters that import only te-serial and
torch). For each job a worker forks a child, which lowers its address space to :data:`AS_LIMIT`
(RLIMIT_AS) and, before each call, its CPU time to twice the call's wall limit (RLIMIT_CPU), and
runs the calls one by one; the worker kills the child when a call passes its wall-clock limit.
Every call ends in an :class:`Outcome`: ``ok``, ``raised`` (with the exception's class, and
whether it is a te-serial error), ``crashed`` (a signal or an exit status) or ``timeout``.
:meth:`Outcome.problem` says what the hostile-input contract forbids: an exception that is not
a te-serial error, a crash, a time-out.

A crash or time-out ends only that call: the calls after it run in a new child.

Run as a script (``python sandbox.py``), this file is the worker; nothing here imports pytest.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

#: address-space limit of each child: room for te-serial's own work on a small checkpoint,
#: far below what an allocation bomb asks for
AS_LIMIT = int(3.5 * 2**30)
#: wall-clock limit of one call; a hostile input must be refused long before
CALL_TIMEOUT_S = 15.0

REPO = Path(__file__).resolve().parents[2]

#: the calls a job may name; args are JSON values (paths as strings)
CALLS = ("load", "open", "read_protos", "verify", "convert")


@dataclass
class Outcome:
    call: str
    status: str                       # "ok" | "raised" | "crashed" | "timeout"
    exc: str | None = None            # "te_serial.errors.ManifestError"
    mro: list = field(default_factory=list)  # class names of the exception's MRO
    te_error: bool = False            # a te_serial.TeSerialError
    checkpoint_error: bool = False    # a te_serial.CheckpointError
    message: str = ""
    traceback: str = ""
    seconds: float = 0.0
    detail: str = ""                  # crashes and time-outs: signal, exit status, child's stderr

    @property
    def exc_name(self) -> str | None:
        return self.exc.rsplit(".", 1)[-1] if self.exc else None

    def problem(self) -> str | None:
        """None when the call loaded or refused with a te-serial error; else what went wrong."""
        if self.status == "ok" or (self.status == "raised" and self.te_error):
            return None
        if self.status == "raised":
            return (f"{self.call}: leaked {self.exc}: {self.message[:500]}\n"
                    f"{self.traceback[-3000:]}")
        return f"{self.call}: {self.status} after {self.seconds:.1f} s: {self.detail[-3000:]}"

    def describe(self) -> str:
        if self.status == "raised":
            return f"{self.call}: {self.exc_name}: {self.message[:300]}"
        return f"{self.call}: {self.status}" + (f" ({self.detail[-300:]})" if self.detail else "")


@dataclass
class Call:
    name: str
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    timeout: float = CALL_TIMEOUT_S


class _Worker:
    """One worker process: reads jobs (lists of calls) on stdin, answers outcomes on stdout."""

    def __init__(self, as_limit: int) -> None:
        self.as_limit = as_limit
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(prefix="te-serial-sandbox-")

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, __file__, str(self.as_limit)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=str(REPO))
        ready = self._read_line(120)
        if ready != {"ready": True}:
            self.stop()
            raise RuntimeError(f"sandbox worker did not start: {ready!r}\n{self._log_tail()}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                f.close()
            self.proc = None

    def run(self, calls: list[Call]) -> list[Outcome]:
        if not calls:
            return []
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        job = [{"name": c.name, "args": c.args, "kwargs": c.kwargs, "timeout": c.timeout} for c in calls]
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._read_line(sum(c.timeout for c in calls) + 60)
        if not isinstance(reply, list):
            self.stop()
            raise RuntimeError(f"sandbox worker failed: {reply!r}\n{self._log_tail()}")
        return [Outcome(**o) for o in reply]

    def _read_line(self, timeout: float):
        poller = select.poll()   # not select(): it refuses descriptors numbered past 1023
        poller.register(self.proc.stdout, select.POLLIN)
        if not poller.poll(timeout * 1000):
            return "no answer"
        line = self.proc.stdout.readline()
        return json.loads(line) if line else "worker exited"

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:].decode(errors="replace")


class Sandbox:
    """Worker processes that run calls in forked, resource-limited children.

    :meth:`run` runs one job (a list of calls); :meth:`run_many` runs many, split over the
    workers side by side, each worker's share in as few children as crashes and time-outs allow
    (a fork per job would cost more than the calls).
    """

    def __init__(self, workers: int = 2, as_limit: int = AS_LIMIT) -> None:
        self.workers = [_Worker(as_limit) for _ in range(max(1, workers))]

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def close(self) -> None:
        for w in self.workers:
            w.stop()
            w.log.close()

    def run(self, calls: list[Call]) -> list[Outcome]:
        """Runs ``calls`` in order in a limited child; one outcome per call."""
        return self.workers[0].run(calls)

    def run_many(self, jobs: list[list[Call]]) -> list[list[Outcome]]:
        flat = [c for job in jobs for c in job]
        n = len(self.workers)
        share = -(-len(flat) // n) if flat else 0
        chunks = [flat[i * share:(i + 1) * share] for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            results = [o for part in pool.map(lambda wc: wc[0].run(wc[1]), zip(self.workers, chunks)) for o in part]
        out, i = [], 0
        for job in jobs:
            out.append(results[i:i + len(job)])
            i += len(job)
        return out


# --------------------------------------------------------------------------------------------
# the worker (this file run as a script) and its children
# --------------------------------------------------------------------------------------------
def _do(name: str, args: list, kwargs: dict):
    import te_serial
    if name == "load":
        te_serial.load_quantized(*args, **kwargs)
    elif name == "open":  # the lazy path: every prototype, then every tensor
        with te_serial.open(*args) as ckpt:
            ckpt.protos
            for key in ckpt.keys():
                ckpt.get(key, **kwargs)
    elif name == "read_protos":
        te_serial.read_protos(*args, **kwargs)
    elif name == "verify":
        te_serial.verify(*args, **kwargs)
    elif name == "convert":
        te_serial.convert(*args, **{"recipe": None, **kwargs})
    else:
        raise ValueError(f"unknown sandbox call {name!r}")


#: calls one child runs before the worker forks a fresh one (bounds what one hostile input can
#: leave behind for the next: memory, open files, caches)
CALLS_PER_CHILD = 48


def _result(c: dict, e: BaseException | None, seconds: float) -> dict:
    import traceback

    import te_serial
    res = {"call": c["name"], "status": "ok", "seconds": seconds}
    if e is not None:
        res.update(status="raised", exc=f"{type(e).__module__}.{type(e).__qualname__}",
                   mro=[k.__qualname__ for k in type(e).__mro__],
                   te_error=isinstance(e, te_serial.TeSerialError),
                   checkpoint_error=isinstance(e, te_serial.CheckpointError))
        try:
            res["message"] = str(e)[:2000]
        except BaseException:  # noqa: BLE001
            res["message"] = "<str() failed>"
        if not res["te_error"]:
            try:
                res["traceback"] = "".join(traceback.format_exception(e))[-6000:]
            except BaseException:  # noqa: BLE001
                res["traceback"] = "<traceback could not be formatted>"
    return res


def _child(calls: list, out_fd: int, as_limit: int) -> None:
    """In the forked child: limits, then each call, one JSON line per call on ``out_fd``."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
    for c in calls:
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(used.ru_utime + used.ru_stime + 2 * c["timeout"]) + 1  # SIGXCPU past this call's share
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        os.write(out_fd, b'{"start": true}\n')
        t0 = time.perf_counter()
        try:
            _do(c["name"], c["args"], c["kwargs"])
            err = None
        except BaseException as e:  # noqa: BLE001 - every class is reported, none escapes
            err = e
        seconds = time.perf_counter() - t0
        try:
            line = json.dumps(_result(c, err, seconds))
        except BaseException as e:  # noqa: BLE001 - e.g. MemoryError: report what is known
            line = json.dumps({"call": c["name"], "status": "raised", "exc": type(err).__name__,
                               "message": f"<result not encodable: {type(e).__name__}>", "seconds": seconds})
        del err
        data = (line + "\n").encode()
        while data:
            data = data[os.write(out_fd, data):]


def _run_calls(calls: list, as_limit: int) -> list:
    """Runs ``calls`` in one forked child; returns the results of those that finished, then (if
    the child died or ran out of time) one for the call it was in, and stops there."""
    results: list = []
    r, w = os.pipe()
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            os.dup2(err.fileno(), 1)
            os.dup2(err.fileno(), 2)
            _child(calls, w, as_limit)
        except BaseException:  # noqa: BLE001 - the harness's own failure: shown in the detail
            import traceback
            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    buf, t0, deadline, status = b"", time.monotonic(), None, None
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([pipe], [], [], wait)
            if not ready:  # the current call ran past its limit
                os.kill(pid, signal.SIGKILL)
                status = "timeout"
                break
            chunk = pipe.read(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if "start" in msg:
                    t0 = time.monotonic()
                    deadline = t0 + calls[len(results)]["timeout"]
                else:
                    results.append(msg)
                    deadline = None
    _, code = os.waitpid(pid, 0)
    if len(results) < len(calls):  # the current call crashed or timed out
        c = calls[len(results)]
        err.seek(0)
        tail = err.read()[-4000:].decode(errors="replace")
        if status == "timeout":
            why = f"no answer after {c['timeout']} s (killed)"
        elif os.WIFSIGNALED(code):
            why = f"killed by signal {signal.Signals(os.WTERMSIG(code)).name}"
        else:
            why = f"exit status {os.waitstatus_to_exitcode(code)}"
        results.append({"call": c["name"], "status": status or "crashed", "seconds": time.monotonic() - t0,
                        "detail": f"{why}\n{tail}"})
    err.close()
    return results


def _run_job(job: list, as_limit: int) -> list:
    """Every call of ``job`` in order, at most :data:`CALLS_PER_CHILD` per child; after a crash or
    a time-out the next call starts in a new child."""
    results: list = []
    while len(results) < len(job):
        results += _run_calls(job[len(results):len(results) + CALLS_PER_CHILD], as_limit)
    return results


def _worker(as_limit: int) -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    import torch
    torch.set_num_threads(1)
    import te_serial  # noqa: F401 - imported once, before any fork
    assert te_serial.load_quantized
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = _run_job(json.loads(line), as_limit)
        except Exception as e:  # noqa: BLE001 - the worker's own failure, reported to the parent
            reply = f"worker error: {type(e).__name__}: {e}"
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
