"""JobBuilder: the device jobs the engine core decided to run, built from its sequences (no trio).

Spec §8: a decode batch is laid out for one compiled profile (``core.decode.build_decode_batch``
with the fair lane order); a prefill runs one request's prompt; the continuation (the same
sequences again, at their next positions) is built from the previous job without the candidate
machinery. A decode job runs :meth:`JobBuilder.decode_steps` greedy steps on the device (runtime
capability multi_step: more than one when every lane allows it, see that method).
Building a job changes no scheduling state except where a method says so (``decode_job`` takes the
chosen sequences out of the ready set and opens their KV transactions); the core records the rest.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from calserve.config import CalserveConfig
from calserve.core.decode import (
    BatchProfile,
    DecodeCandidate,
    LaneOrder,
    build_decode_batch,
    select_profile,
)
from calserve.engine.batch_fast import single_tenant_lanes
from calserve.engine.completion import PLAIN_GREEDY
from calserve.engine.state import DeviceJob, Seq
from calserve.runtime.types import JobResult, JobStatus

if TYPE_CHECKING:
    from calserve.engine.generations import Generation

__all__ = ["JobBuilder", "BatchStats", "decode_steps"]


def decode_steps(limit: int, seqs: Sequence[Seq], positions: Sequence[int] | None = None,
                 pending: int | Sequence[int] = 0) -> tuple[int, list[int] | None]:
    """The greedy steps a decode job over ``seqs`` runs, and each sequence's own (None: all the
    job's). One step unless ``limit`` > 1 (the generation's ``multi_step``) and every sequence is
    plain greedy (nothing but the argmax decides its tokens, so the device's argmax is the
    host's) and not scoring its prompt; then each sequence runs the least of ``limit``, its
    remaining tokens (``max_tokens``) and its KV reservation's room, and the job the most of
    those: no sequence's steps pass a length limit, so one ends inside a job only on EOS or a stop
    token. ``positions`` (default: each ``Seq.position``) and ``pending`` (tokens a sequence has
    produced that its bookkeeping has not counted yet, one figure or one per sequence): the fast
    path builds the next job before the completion's bookkeeping, with the positions and token
    counts after it."""
    if limit <= 1 or not all(map(PLAIN_GREEDY, seqs)):
        return 1, None
    per: list[int] = []
    for i, s in enumerate(seqs):
        if s.score_upto is not None:
            return 1, None
        left = s.req.sampling.max_tokens - s.generated - (pending if isinstance(pending, int) else pending[i])
        room = s.lease.reserved_len - (s.position if positions is None else positions[i])
        n = min(limit, left, room)
        per.append(n if n > 1 else 1)
    steps = max(per)
    if steps == 1:
        return 1, None
    return steps, (None if min(per) == steps else per)


@dataclasses.dataclass(frozen=True)
class BatchStats:
    batches_total: dict[int, int]  # decode jobs by compiled batch
    lanes_active_total: dict[int, int]  # active lanes of those jobs
    lanes_total: dict[int, int]  # compiled lanes of those jobs
    prefill_jobs_total: int
    batch_wait_s_total: float  # summed time sequences waited in the ready set before a batch
    continuations_total: int  # decode jobs built by the continuation shortcut
    decode_steps_total: dict[int, int]  # greedy steps those decode jobs ran (multi-step: > jobs)


class JobBuilder:
    def __init__(self, cfg: CalserveConfig) -> None:
        self.cfg = cfg
        self._profiles: dict[tuple[int, int], BatchProfile] = {}  # (generation id, B) -> profile
        self._valid_masks: dict[tuple[int, int], np.ndarray] = {}  # (B, active lanes) -> mask
        self.batches_total: dict[int, int] = collections.Counter()
        self.lanes_active_total: dict[int, int] = collections.Counter()
        self.lanes_total: dict[int, int] = collections.Counter()
        self.decode_steps_total: dict[int, int] = collections.Counter()
        self.prefill_jobs_total = 0
        self.batch_wait_s_total = 0.0
        self.continuations_total = 0
        # the one-tenant decode batch without the candidate machinery (engine/batch_fast.py);
        # False: every batch through core.decode.build_decode_batch (tests compare the two)
        self.fast = True
        # Whether a prompt of ``gen`` waits for its prefill (the core sets it): a decode job then
        # runs one step, so the prefill is not held behind a multi-step job (time to first token)
        self.prefill_waiting: Callable[[Generation], bool] = lambda gen: False

    def step_limit(self, gen: Generation) -> int:
        """The most greedy steps a decode job of ``gen`` may run now (:func:`decode_steps`'s
        ``limit``): the generation's ``multi_step``, one while a prompt waits for its prefill."""
        n = gen.multi_step
        return n if n == 1 or not self.prefill_waiting(gen) else 1

    def ran_short(self, job: DeviceJob, r: JobResult) -> int:
        """``job``, a run the host drives, came back ``r`` OK with lanes short of their steps
        (``r.lane_steps``, each lane's steps run: it ended on an end token, ``completion.run_ends``,
        or the run was asked to stop, ``Planner.stop_runs``; its step tokens then as many as the
        run ran): from now on it is the job of the steps it turned out to be, each sequence its
        own steps run (its echo, its KV transaction, the step counts). Returns the run's steps it
        did not run (0 for anything else, left as it is; a short result it does not take,
        ``step_rows`` refuses as a crosstalk)."""
        t, got = r.step_tokens, r.lane_steps
        if not (r.status is JobStatus.OK and job.steps > 1 and t is not None and t.ndim == 2
                and 1 <= t.shape[1] <= job.steps and got is not None and len(got) == len(job.lanes)):
            return 0
        ran = int(t.shape[1])
        per = job.seq_steps or [job.steps] * len(job.seqs)
        new = [max(1, min(n, k, ran)) for n, k in zip(per, got[job.active].tolist(), strict=True)]
        if new == per:
            return 0
        job.expect = [(sid, p - n + k) for (sid, p), n, k in zip(job.expect, per, new, strict=True)]
        job.gen.kv.shorten_decode([s.lease.lane for s in job.seqs], new)
        cut = job.steps - ran
        self.decode_steps_total[len(job.lanes)] -= cut
        job.steps = ran
        job.seq_steps = None if min(new) == ran else new
        return cut

    def profile(self, gen: Generation, B: int) -> BatchProfile:
        profile = self._profiles.get((gen.id, B))
        if profile is None:  # a generation is immutable: build each member's profile once
            cb = gen.calbins[B]
            profile = self._profiles[(gen.id, B)] = BatchProfile(
                B, gen.max_seq, valid_mask=cb.spec.valid_mask or B == 1,
                inactive_writes_kv=cb.spec.inactive_writes_kv)
        return profile

    def forget(self, gen: Generation) -> None:
        """A generation was unloaded: drop its cached profiles."""
        for key in [k for k in self._profiles if k[0] == gen.id]:
            del self._profiles[key]

    def prefill_job(self, gen: Generation, seq: Seq, now: float) -> DeviceJob:
        self.prefill_jobs_total += 1
        whole = seq.score_whole_prompt(gen)  # before prefill_input: it may take the whole prompt
        return DeviceJob("prefill", gen, [seq], seq.prefill_input(), np.zeros(1, np.int32),
                         np.ones(1, np.uint8), now, all_logits=whole)

    def decode_batch(self, gen: Generation, ready: dict[int, Seq], now: float, B: int,
                     earliest: float | None) -> tuple[DeviceJob | None, list[tuple[int, str]] | str]:
        """A decode batch for compiled batch ``B`` over the ready set (fair lane order), and the
        ready sequences it skipped with why (``batch_full``, ``tenant_share``, ``deadline``,
        ``length``) for the core to act on. The chosen sequences leave ``ready`` and their KV
        transaction opens. The skipped ones as ``(request id, why)`` in ready order, or, when
        every sequence left in ``ready`` was skipped for the same reason (the one-tenant pick),
        that reason alone (a str: no list of pairs per batch). ``earliest``: the ready set's
        earliest deadline (``batch_fast.earliest_deadline``)."""
        profile = self.profile(gen, B)
        fcfg = self.cfg.scheduler.fairness
        if self.fast and fcfg.policy != "fcfs":
            picked = single_tenant_lanes(ready, now, B, profile.max_seq,
                                         fcfg.deadline_urgency_ms * 1e-3, fcfg.tenant_max_lane_share,
                                         earliest)
            if picked is not None:
                return self.picked_batch(gen, ready, now, B, profile, *picked)
        gid = gen.id
        cands = [  # positional (request_id, seq_id, tenant, generation, last_token, position, deadline,
            # virtual_finish, cancelled, lane, arrival): one per ready sequence per batch
            DecodeCandidate(s.rid, -1 if s.seq_id is None else s.seq_id, s.req.tenant, gid, s.last_token,
                            s.position, s.deadline, s.ready_since, s.pending_reason is not None,
                            s.lease.lane, s.arrival)
            for s in ready.values()
        ]
        if fcfg.policy == "fcfs":
            order = LaneOrder(policy="fcfs")
        else:
            adm = gen.admission
            tenants = {c.tenant for c in cands}
            order = LaneOrder(
                urgency_s=fcfg.deadline_urgency_ms * 1e-3,
                tenant_vt={t: adm.lane_virtual_time(t) for t in tenants},
                tenant_weight={t: adm.weight(t) for t in tenants},
                token_cost=fcfg.output_token_cost,
            )
        batch = build_decode_batch(profile, cands, now, gen.id, fcfg.tenant_max_lane_share, order)
        if batch.empty:
            return None, list(batch.skipped)
        lanes: list[Seq | None] = []
        wait = 0.0
        for c in batch.lanes:
            if c is None:
                lanes.append(None)
                continue
            seq = ready.pop(c.request_id)
            seq.passed_over = 0
            wait += now - seq.ready_since
            lanes.append(seq)
        chosen = [s for s in lanes if s is not None]
        steps, per = decode_steps(self.step_limit(gen), chosen)
        for k, seq in enumerate(chosen):
            gen.kv.begin_update(seq.lease.lane, seq.position, steps if per is None else per[k])
        job = self._decode_job(gen, B, lanes, batch.token_ids, batch.positions, batch.valid_mask,
                               batch.seq_ids, now, steps, per)
        self.batch_wait_s_total += wait
        self.record_decode(job)
        return job, list(batch.skipped)

    def picked_batch(self, gen: Generation, ready: dict[int, Seq], now: float, B: int,
                      profile: BatchProfile, chosen: list[Seq], why: str
                      ) -> tuple[DeviceJob | None, str]:
        """:meth:`decode_batch` for lanes :func:`single_tenant_lanes` chose (the same lanes and
        skip reasons the general builder gives that ready set)."""
        n = len(chosen)
        fill = B - n
        wait = 0.0
        for seq in chosen:
            del ready[seq.rid]
            seq.passed_over = 0
            wait += now - seq.ready_since
        positions = [s.position for s in chosen]
        steps, per = decode_steps(self.step_limit(gen), chosen)
        # every chosen lane's KV transaction opens, in lane order (begin_update per lane, one call)
        gen.kv.begin_decode([s.lease.lane for s in chosen], positions, steps if per is None else per)
        sids = [-1 if s.seq_id is None else s.seq_id for s in chosen]
        # One int32 [3, B] array, its rows (contiguous views) are the job's tensors.
        host = np.array(([s.last_token for s in chosen] + [profile.inactive_token_id] * fill,
                         positions + [profile.inactive_position] * fill, sids + [-1] * fill),
                        np.int32)
        job = DeviceJob("decode", gen, [*chosen, *([None] * fill)], host[0], host[1],
                        self._valid(B, n), now, seq_ids=host[2], calbin=gen.calbins[B])
        if steps > 1:
            job.steps = steps  # the device echoes each lane's last step's position
            job.seq_steps = per
            job.expect = [(sid, p + n - 1) for sid, p, n in zip(sids, positions, per or [steps] * n)]
        else:
            job.expect = list(zip(sids, positions))  # active == 0..n-1: the chosen lanes
        self.batch_wait_s_total += wait
        self.record_decode(job)
        return job, why  # every sequence left in ready was skipped for ``why``

    def _valid(self, B: int, n: int) -> np.ndarray:
        """The uint8 valid mask of a batch of ``B`` lanes whose first ``n`` are active: one
        read-only array per (B, n), shared by every such job (a job's arrays are never written
        after construction; the continuation shares its predecessor's too)."""
        v = self._valid_masks.get((B, n))
        if v is None:
            v = np.array([1] * n + [0] * (B - n), np.uint8)
            v.flags.writeable = False
            self._valid_masks[(B, n)] = v
        return v

    def next_profile(self, done: DeviceJob) -> int | None:
        """The compiled batch a full pass would pick for ``done``'s sequences alone (None: not the
        profile ``done`` runs on, for a decode job)."""
        gen = done.gen
        n = len(done.seqs)
        if gen.selecting:
            B = select_profile(n, 0.0, gen.calbins, self.cfg.scheduler.batch.selection)
        else:
            B = gen.compiled_batch
        if done.kind == "decode" and B != len(done.lanes):
            return None
        return B

    def continuation(self, done: DeviceJob, tokens: list[int], positions: list[int], now: float,
                     pending: int | list[int] = 0) -> DeviceJob:
        """The job that runs ``done``'s sequences again in the same lanes with ``tokens`` at
        ``positions`` (one per sequence, in lane order); after a prefill, its sequence's first decode
        step in lane 0 of the profile :meth:`next_profile` picks (what the batch builder lays out
        for one candidate). ``pending``: tokens of ``done`` not counted yet (:func:`decode_steps`).
        Changes no state: the core commits it."""
        steps, per = decode_steps(self.step_limit(done.gen), done.seqs, positions, pending)
        if done.kind == "prefill":
            return self._first_decode_job(done, tokens[0], positions[0], now, steps)
        if per is None:
            last = steps - 1
            expect = [(sid, p + last) for (sid, _), p in zip(done.expect, positions, strict=True)]
        else:
            expect = [(sid, p + n - 1) for (sid, _), p, n in zip(done.expect, positions, per, strict=True)]
        if len(tokens) == len(done.lanes):  # every lane active (in lane order): no filler lanes
            job = done.successor(np.array(tokens, np.int32), np.array(positions, np.int32), now, expect)
        else:
            toks = done.tokens.tolist()  # inactive lanes keep the declared filler token/position
            pos = done.positions.tolist()
            for i, t, p in zip(done.active, tokens, positions, strict=True):
                toks[i] = t
                pos[i] = p
            job = done.successor(np.array(toks, np.int32), np.array(pos, np.int32), now, expect)
        job.steps = steps
        job.seq_steps = per
        return job

    def _first_decode_job(self, done: DeviceJob, token: int, position: int, now: float,
                          steps: int = 1) -> DeviceJob:
        gen = done.gen
        B = self.next_profile(done)
        assert B is not None
        profile = self.profile(gen, B)
        seq = done.seqs[0]
        sid = -1 if seq.seq_id is None else seq.seq_id
        fill = B - 1
        return self._decode_job(
            gen, B, [seq, *([None] * fill)], [token] + [profile.inactive_token_id] * fill,
            [position] + [profile.inactive_position] * fill, [1] + [0] * fill, [sid] + [-1] * fill,
            now, steps)

    def _decode_job(
        self, gen: Generation, B: int, lanes: list[Seq | None], token_ids: Sequence[int],
        positions: Sequence[int], valid: Sequence[int], seq_ids: Sequence[int], created: float,
        steps: int = 1, per: list[int] | None = None,
    ) -> DeviceJob:
        """A decode job over ``B`` lanes (inactive ones: None, with the profile's filler token and
        position) on the generation's member for ``B``, running ``steps`` greedy steps (each active
        lane its ``per`` entry of them, when given); changes no scheduling state."""
        # One int32 [3, B] array, its rows (contiguous views) are the job's tensors.
        host = np.array((token_ids, positions, seq_ids), np.int32)
        job = DeviceJob("decode", gen, lanes, host[0], host[1], np.asarray(valid, np.uint8), created,
                        seq_ids=host[2], calbin=gen.calbins[B], steps=steps, seq_steps=per)
        ns = per or [steps] * len(job.active)
        job.expect = [(seq_ids[i], positions[i] + n - 1) for i, n in zip(job.active, ns)]
        return job

    def record_decode(self, job: DeviceJob) -> None:
        """Statistics of a decode job that was handed to an executor."""
        B = len(job.lanes)
        self.batches_total[B] += 1
        self.lanes_active_total[B] += len(job.seqs)
        self.lanes_total[B] += B
        self.decode_steps_total[B] += job.steps

    def statistics(self) -> BatchStats:
        return BatchStats(dict(self.batches_total), dict(self.lanes_active_total),
                          dict(self.lanes_total), self.prefill_jobs_total, self.batch_wait_s_total,
                          self.continuations_total, dict(self.decode_steps_total))
