"""``calserve device-check``: the spec §18 integration matrix, driving the runtime facade directly.

For every profile of a verified package (no engine involved) it checks, against the package's golden
tokens (which are the numpy reference's greedy tokens):

=========================  =====================================  ===============================
check                      B1                                     B>1
=========================  =====================================  ===============================
introspection              runtime view == manifest (§11 step 8)  same
single seq                 prefill + decode == golden             same, one valid lane
two seqs alternating       A, B, A, B ... == golden               same
lanes 1..B filled          N/A                                    n valid lanes, n = 1..B
inactive lanes no KV       N/A                                    parked seq's KV bytes unchanged
mixed lengths              software alternation                   different lengths, one batch
cancel                     result of a running job discarded,     one lane's result discarded,
                           job drained, KV freed after it         whole batch drained
ping/pong                  one job on each engine                 one B-lane job on each engine
timeout recovered          WaitTimeout -> reset -> ABORTED -> ok  same
ccu fault recovered        CCU_FAULT -> reset -> ok               all lanes fail, reset -> ok
load/unload soak           N cycles, DRAM back to baseline        same
=========================  =====================================  ===============================

Profiles the runtime cannot run (B>1 on ``calrt-0.7.6``) get N/A rows. A row is PASS, FAIL (exit
non-zero) or N/A, with the measured figure.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

import numpy as np

from calserve.errors import CalserveError
from calserve.models.manifest import GoldenCase
from calserve.models.package import VerifiedPackage
from calserve.models.validate import compare_introspection
from calserve.runtime.types import (
    RUNTIME_PROFILES,
    CalrtError,
    FaultKind,
    JobEngine,
    JobStatus,
    NotSupported,
    Timing,
    WaitTimeout,
)

__all__ = ["CheckRow", "run_device_check", "golden_run", "print_table", "CHECKS"]

WAIT_S = 30.0
CHECKS = (
    "introspection",
    "single seq prefill+decode",
    "two seqs alternating",
    "lanes 1..B filled",
    "inactive lanes no KV write",
    "mixed lengths",
    "cancel: result discarded, drained",
    "ping/pong two jobs",
    "timeout recovered",
    "ccu fault recovered",
    "load/unload soak",
)


@dataclasses.dataclass(frozen=True)
class CheckRow:
    check: str
    profile: str  # "B1", "B4", ...
    status: str  # PASS | FAIL | N/A
    figure: str  # measured figure or the reason


class CheckFailed(Exception):
    pass


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


@dataclasses.dataclass
class _Seq:
    """One sequence being driven: its golden case and what the device produced so far."""

    seq_id: int
    case: GoldenCase
    want: list[int]
    got: list[int] = dataclasses.field(default_factory=list)
    pos: int = 0  # committed length = next decode position

    @property
    def done(self) -> bool:
        return len(self.got) >= len(self.want)


def _ok(res: Any, what: str) -> Any:
    _expect(res.status == JobStatus.OK, f"{what}: job status {JobStatus(res.status).name}")
    return res


def _prefill(cb: Any, s: _Seq, engine: JobEngine = JobEngine.PING) -> None:
    res = _ok(cb.submit_prefill(s.seq_id, s.case.prompt, engine).wait(WAIT_S), "prefill")
    s.pos = len(s.case.prompt)
    s.got.append(int(np.argmax(res.logits[0])))


def _decode(cb: Any, lanes: Sequence[_Seq], engine: JobEngine = JobEngine.PING) -> Any:
    """One decode step with ``lanes`` valid (in lanes 0..n-1), the rest inactive."""
    return _submit_decode(cb, lanes, engine).wait(WAIT_S)


def _submit_decode(cb: Any, lanes: Sequence[_Seq], engine: JobEngine = JobEngine.PING) -> Any:
    b = cb.spec.compiled_batch
    seq_ids, toks, pos, valid = [0] * b, [0] * b, [0] * b, [False] * b
    for i, s in enumerate(lanes):
        seq_ids[i], toks[i], pos[i], valid[i] = s.seq_id, s.got[-1], s.pos, True
    return cb.submit_decode(seq_ids, toks, pos, valid, engine)


def _absorb(res: Any, lanes: Sequence[_Seq]) -> None:
    _ok(res, "decode")
    for i, s in enumerate(lanes):
        _expect(int(res.echo[i][1]) == s.seq_id, f"lane {i}: echo seq {int(res.echo[i][1])} != {s.seq_id}")
        _expect(int(res.echo[i][2]) == s.pos, f"lane {i}: echo position {int(res.echo[i][2])} != {s.pos}")
        s.pos += 1
        s.got.append(int(np.argmax(res.logits[i])))


def _new(cb: Any, case: GoldenCase) -> _Seq:
    b = cb.spec.compiled_batch
    return _Seq(cb.create_sequence(), case, list(case.expected[b]))


def _finish(cb: Any, seqs: Iterable[_Seq]) -> None:
    for s in seqs:
        _expect(s.got[: len(s.want)] == s.want, f"seq {s.seq_id}: tokens {s.got} != golden {s.want}")
        cb.free_sequence(s.seq_id)


def _run_batch(cb: Any, seqs: list[_Seq]) -> int:
    """Prefill all, then decode them together (lanes shrink as sequences finish). Returns tokens."""
    for s in seqs:
        _prefill(cb, s)
    n = 0
    while active := [s for s in seqs if not s.done]:
        _absorb(_decode(cb, active), active)
        n += len(active)
    return n


def _cases(vp: VerifiedPackage) -> list[GoldenCase]:
    return [c for c in vp.golden().cases if all(c.expected.values())]


# ---- the checks (each returns its figure or raises CheckFailed) --------------------------------


def _single(cb: Any, cases: list[GoldenCase]) -> str:
    t0, n = time.perf_counter(), 0
    for c in cases:
        s = _new(cb, c)
        n += _run_batch(cb, [s]) + 1
        _finish(cb, [s])
    return f"{n} tokens == golden, {n / (time.perf_counter() - t0):.0f} tok/s"


def _alternating(cb: Any, cases: list[GoldenCase], k: int) -> str:
    seqs = [_new(cb, cases[i % len(cases)]) for i in range(k)]
    for s in seqs:
        _prefill(cb, s)
    while active := [s for s in seqs if not s.done]:
        for s in active:  # one sequence per job, alternating
            _absorb(_decode(cb, [s]), [s])
    _finish(cb, seqs)
    return f"{k} seqs interleaved == golden"


def _lanes(cb: Any, cases: list[GoldenCase]) -> str:
    b = cb.spec.compiled_batch
    for n in range(1, b + 1):
        seqs = [_new(cb, cases[i % len(cases)]) for i in range(n)]
        _run_batch(cb, seqs)
        _finish(cb, seqs)
    return f"n=1..{b} lanes == golden"


def _inactive_no_kv(cb: Any, cases: list[GoldenCase]) -> str:
    parked = _new(cb, cases[0])
    _prefill(cb, parked)
    try:
        before = cb.read_kv(parked.seq_id).copy()
    except NotSupported:
        before = None
    live = _new(cb, cases[1 % len(cases)])
    _prefill(cb, live)
    b = cb.spec.compiled_batch
    # The parked sequence sits in every inactive lane, with a token and its next position.
    seq_ids, toks, pos = [parked.seq_id] * b, [parked.got[-1]] * b, [parked.pos] * b
    valid = [False] * b
    seq_ids[0], toks[0], pos[0], valid[0] = live.seq_id, live.got[-1], live.pos, True
    res = _ok(cb.submit_decode(seq_ids, toks, pos, valid).wait(WAIT_S), "decode")
    _expect(cb.committed_len(parked.seq_id) == parked.pos, "inactive lane changed committed_len")
    if before is not None:
        _expect(np.array_equal(cb.read_kv(parked.seq_id), before), "inactive lane wrote KV bytes")
    _expect(bool(np.all(res.logits[1:] == 0)), "inactive lanes returned non-zero logits")
    live.pos += 1
    live.got.append(int(np.argmax(res.logits[0])))
    # Both continue correctly afterwards.
    _run_rest(cb, [parked, live])
    _finish(cb, [parked, live])
    return "KV bytes + committed_len unchanged" if before is not None else "committed_len unchanged"


def _run_rest(cb: Any, seqs: list[_Seq]) -> None:
    while active := [s for s in seqs if not s.done]:
        _absorb(_decode(cb, active), active)


def _mixed(cb: Any, cases: list[GoldenCase]) -> str:
    lens = sorted({len(c.prompt) for c in cases})
    if cb.spec.compiled_batch == 1:
        _alternating(cb, cases, len(cases))
        return f"prompt lengths {lens}, software alternation"
    seqs = [_new(cb, c) for c in cases[: cb.spec.compiled_batch]]
    _run_batch(cb, seqs)
    _finish(cb, seqs)
    return f"prompt lengths {lens} in one batch"


def _cancel(cb: Any, cases: list[GoldenCase]) -> str:
    keep, drop = _new(cb, cases[0]), _new(cb, cases[1 % len(cases)])
    _prefill(cb, keep)
    _prefill(cb, drop)
    if cb.spec.compiled_batch == 1:
        job = _submit_decode(cb, [drop])  # "running" job of the cancelled request
        res = job.wait(WAIT_S)  # it still drains; its result is discarded
        _ok(res, "cancelled job")
    else:
        res = _submit_decode(cb, [keep, drop]).wait(WAIT_S)  # lane 1 cancelled while in flight
        _ok(res, "batch")
        keep.pos += 1
        keep.got.append(int(np.argmax(res.logits[0])))
    cb.free_sequence(drop.seq_id)  # only after the job answered
    _run_rest(cb, [keep])
    _finish(cb, [keep])
    return "batch drained, survivor == golden"


def _pingpong(cb: Any, cases: list[GoldenCase]) -> str:
    a, b_ = _new(cb, cases[0]), _new(cb, cases[1 % len(cases)])
    _prefill(cb, a, JobEngine.PING)
    _prefill(cb, b_, JobEngine.PONG)
    while not (a.done and b_.done):
        ja = None if a.done else _submit_decode(cb, [a], JobEngine.PING)
        jb = None if b_.done else _submit_decode(cb, [b_], JobEngine.PONG)
        if ja is not None:
            _absorb(ja.wait(WAIT_S), [a])
        if jb is not None:
            _absorb(jb.wait(WAIT_S), [b_])
    _finish(cb, [a, b_])
    return "PING+PONG in flight == golden"


def _recover(dev: Any, cb: Any, cases: list[GoldenCase], kind: FaultKind) -> str:
    lanes = [_new(cb, cases[i % len(cases)]) for i in range(min(2, cb.spec.compiled_batch))]
    for s in lanes:
        _prefill(cb, s)
    dev.inject_fault(kind, JobEngine.PING, 1)
    job = _submit_decode(cb, lanes)
    t0 = time.perf_counter()
    if kind == FaultKind.TIMEOUT:
        try:
            job.wait(0.2)
            raise CheckFailed("injected timeout: Wait returned")
        except WaitTimeout:
            pass
        dev.reset(cb.chip)
        res = job.wait(WAIT_S)
        _expect(res.status == JobStatus.ABORTED, f"after reset: {JobStatus(res.status).name}, not ABORTED")
    else:
        res = job.wait(WAIT_S)
        _expect(res.status == JobStatus.CCU_FAULT, f"injected CCU fault: {JobStatus(res.status).name}")
        dev.reset(cb.chip)
    for s in lanes:
        _expect(not cb.sequence_valid(s.seq_id), f"seq {s.seq_id} still valid after reset")
        cb.free_sequence(s.seq_id)
    s = _new(cb, cases[0])
    _run_batch(cb, [s])
    _finish(cb, [s])
    return f"{len(lanes)} lane(s) failed together, recovered in {(time.perf_counter() - t0) * 1e3:.1f} ms"


def _soak(dev: Any, vp: VerifiedPackage, weights: Any, b: int, cycles: int) -> str:
    cfg, spec = vp.manifest.model_config(), vp.manifest.profile_spec(b)
    base = dev.dram()[1]
    case = _cases(vp)[0]
    t0 = time.perf_counter()
    for _ in range(cycles):
        cb = dev.load_calbin(cfg, weights, spec, Timing())
        s = _new(cb, case)
        _prefill(cb, s)
        _expect(s.got[0] == s.want[0], "first token after reload != golden")
        cb.free_sequence(s.seq_id)
        cb.release()
        _expect(dev.dram()[1] == base, f"DRAM used {dev.dram()[1]} != baseline {base} after unload")
    return f"{cycles} cycles, DRAM back to {base} B, {(time.perf_counter() - t0) / cycles * 1e3:.1f} ms/cycle"


def _introspection(m: Any, b: int, cb: Any) -> str:
    compare_introspection(m, b, cb.introspect())
    return "matches manifest"


def golden_run(dev: Any, vp: VerifiedPackage, compiled_batch: int) -> tuple[bool, str]:
    """Load one profile, run every golden case (one lane), release. (ok, figure or reason)."""
    m = vp.manifest
    cb = dev.load_calbin(m.model_config(), vp.weights(), m.profile_spec(compiled_batch), Timing())
    try:
        return True, _single(cb, _cases(vp))
    except (CheckFailed, CalrtError) as e:
        return False, str(e)
    finally:
        cb.release()


def run_device_check(
    vp: VerifiedPackage, runtime: str = "calrt-0.7.6", *, soak_cycles: int = 10
) -> list[CheckRow]:
    """Open the runtime, run the matrix for every profile of ``vp``, close. One row per check."""
    from calserve.runtime import Device

    caps = RUNTIME_PROFILES[runtime]
    m = vp.manifest
    weights = vp.weights()
    cases = _cases(vp)
    rows: list[CheckRow] = []
    with Device.open(profile=runtime) as dev:
        for b in m.compiled_batches:
            tag = f"B{b}"
            if b > 1 and not caps.batch_profiles:
                rows += [CheckRow(c, tag, "N/A", f"{runtime}: no batch profiles (C3)") for c in CHECKS]
                continue
            try:
                cb = dev.load_calbin(m.model_config(), weights, m.profile_spec(b), Timing())
            except CalrtError as e:
                rows += [CheckRow(c, tag, "FAIL", f"load: {e}") for c in CHECKS]
                continue
            plan: list[tuple[str, Callable[[], str] | None]] = [
                ("introspection", lambda: _introspection(m, b, cb)),
                ("single seq prefill+decode", lambda: _single(cb, cases)),
                ("two seqs alternating", lambda: _alternating(cb, cases, 2)),
                ("lanes 1..B filled", None if b == 1 else lambda: _lanes(cb, cases)),
                ("inactive lanes no KV write", None if b == 1 else lambda: _inactive_no_kv(cb, cases)),
                ("mixed lengths", lambda: _mixed(cb, cases)),
                ("cancel: result discarded, drained", lambda: _cancel(cb, cases)),
                ("ping/pong two jobs", (lambda: _pingpong(cb, cases)) if caps.pingpong else None),
                ("timeout recovered", lambda: _recover(dev, cb, cases, FaultKind.TIMEOUT)),
                ("ccu fault recovered", lambda: _recover(dev, cb, cases, FaultKind.CCU_FAULT)),
            ]
            for name, fn in plan:
                rows.append(_row(name, tag, fn, dev, cb))
            cb.release()
            rows.append(_row("load/unload soak", tag, lambda: _soak(dev, vp, weights, b, soak_cycles), dev, None))
    return rows


def _row(name: str, tag: str, fn: Callable[[], str] | None, dev: Any, cb: Any) -> CheckRow:
    if fn is None:
        return CheckRow(name, tag, "N/A", "not applicable at B1 (spec §18)")
    try:
        return CheckRow(name, tag, "PASS", fn())
    except (CheckFailed, CalrtError, CalserveError, ValueError) as e:
        # Leave the device usable for the next check: reset aborts leftovers, free every sequence.
        try:
            dev.reset()
            if cb is not None:
                for sid in range(cb.spec.max_sequences):
                    try:
                        cb.free_sequence(sid)
                    except CalrtError:
                        pass
        except CalrtError:
            pass
        return CheckRow(name, tag, "FAIL", f"{type(e).__name__}: {e}")


def print_table(rows: Sequence[CheckRow], out: IO[str]) -> None:
    w = max(len(r.check) for r in rows) if rows else 10
    out.write(f"{'check':<{w}}  profile  result  figure\n")
    for r in rows:
        out.write(f"{r.check:<{w}}  {r.profile:<7}  {r.status:<6}  {r.figure}\n")
    n_fail = sum(r.status == "FAIL" for r in rows)
    out.write(f"{len(rows)} checks: {sum(r.status == 'PASS' for r in rows)} PASS, {n_fail} FAIL, "
              f"{sum(r.status == 'N/A' for r in rows)} N/A\n")
