"""The pure rules of a completed step: what each lane must echo, sampling, and the finish rule.

Used by :class:`~calserve.engine.core.EngineCore` on both completion paths (the general one and
the fast continuation, which decides before the bookkeeping): they must agree, so they share these.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from operator import attrgetter

import numpy as np

from calserve.engine.logits import LaneLogits, lane_logits
from calserve.engine.sampler import LaneSampling, greedy_argmax, sample_batch, score_tokens
from calserve.engine.state import DeviceJob, Seq
from calserve.engine.types import FinishReason, TokenLogprob
from calserve.runtime.types import RunEnds

__all__ = ["SAMPLE_FAILED", "PLAIN_GREEDY", "Sampled", "ends", "ends_run", "expect", "out_lanes", "run_ends",
           "sample", "step_rows"]

log = logging.getLogger("calserve.engine.completion")

#: The token of a lane whose sampling raised: the request fails alone (issue 12, defence in depth).
SAMPLE_FAILED = -1

Sampled = tuple[list[int], list[TokenLogprob | None]]

#: A sequence's ``plain_greedy`` (nothing but the argmax decides its tokens), read in C per batch
PLAIN_GREEDY = attrgetter("req.sampling.plain_greedy")


def ends(s: Seq, tok: int, generated: int, position: int, now: float,
         eos: Collection[int]) -> FinishReason | None:
    """Why ``s`` ends with ``tok`` as its ``generated``-th token and ``position`` committed, or None.

    The one finish rule of a completed step: the general path (after the bookkeeping) and the fast
    path (before it, with the values the bookkeeping will set) must agree, or a continuation would
    be built for a sequence the bookkeeping ends."""
    sp = s.req.sampling
    if generated > sp.min_tokens and ((tok in eos and not sp.ignore_eos) or tok in sp.stop_token_ids):
        return FinishReason.STOP
    if generated >= sp.max_tokens or position >= s.lease.reserved_len:
        return FinishReason.LENGTH
    if s.deadline is not None and s.deadline <= now:
        return FinishReason.DEADLINE
    return None


def ends_run(s: Seq, toks: list[int], generated: int, position: int, now: float,
             eos: Collection[int]) -> tuple[int, FinishReason | None]:
    """:func:`ends` of each token of a multi-step job's run in turn (token ``i`` as the
    ``generated + i + 1``-th at ``position + i + 1``): ``(k, reason)``, the first ``k`` tokens kept
    and why the sequence ends with the ``k``-th, or ``(len(toks), None)`` when none ends it. The
    length and deadline checks are arithmetic (the first token they end at), the stop check a scan
    up to there; ``tests/engine/test_multi_step_fake.py`` checks it against :func:`ends`."""
    sp = s.req.sampling
    end = len(toks) - 1  # the last token that can end it, and why
    why: FinishReason | None = None
    if s.deadline is not None and s.deadline <= now:
        end, why = 0, FinishReason.DEADLINE
    length = min(sp.max_tokens - generated, s.lease.reserved_len - position) - 1
    if length <= end:  # LENGTH before DEADLINE on the same token
        end, why = max(0, length), FinishReason.LENGTH
    stop_ids = sp.stop_token_ids
    check_eos = not sp.ignore_eos
    for i in range(max(0, sp.min_tokens - generated), end + 1):
        t = toks[i]
        if (check_eos and t in eos) or t in stop_ids:
            return i + 1, FinishReason.STOP
    return end + 1, why


def run_ends(job: DeviceJob) -> RunEnds:
    """Each lane's end tokens for a multi-step decode the host drives (``ext/host_steps.h``,
    ``hs_start_ends``): its EOS ids (unless ``ignore_eos``) and ``stop_token_ids``, counted from
    the first step whose token :func:`ends` would let end it (``min_tokens``). A lane that draws
    one ends with that step instead of running its other steps for nothing: its client gets its
    last event a step later instead of at the run's end, and the run ends once no lane runs.

    ``Seq.generated`` may lag the tokens a completion in flight has drawn (the fast path builds a
    job before that completion's bookkeeping): a lower bound, so the first counted step is never
    too early. Either way the host's :func:`ends_run` decides the sequence's end from the tokens;
    a lane ended on a token it would not end on is a shorter run of the same tokens."""
    B = len(job.lanes)
    eos = job.gen.source.eos_token_ids
    off = [0] * (B + 1)
    ids: list[int] = []
    frm: list[int] | None = None
    for lane, s in enumerate(job.lanes):
        if s is not None:
            sp = s.req.sampling
            if not sp.ignore_eos:
                ids.extend(eos)
            if sp.stop_token_ids:
                ids.extend(sp.stop_token_ids)
            if sp.min_tokens > s.generated:
                if frm is None:
                    frm = [0] * B
                frm[lane] = sp.min_tokens - s.generated
        off[lane + 1] = len(ids)
    return (np.array(off, np.int32), np.array(ids, np.int32),
            None if frm is None else np.array(frm, np.int32))


def expect(job: DeviceJob) -> list[tuple[int, int]]:
    """(seq_id, position) each active lane must echo (:func:`out_lanes`): for a prefill, its last
    prompt position (every one, in order, for a prefill with every position's logits)."""
    if job.kind == "decode":
        return job.expect
    s = job.lanes[0]
    assert s is not None and s.seq_id is not None
    if job.all_logits:
        return [(s.seq_id, s.position + i) for i in range(len(job.tokens))]
    return [(s.seq_id, s.position + len(job.tokens) - 1)]


def step_rows(job: DeviceJob, logits: np.ndarray, step_tokens: np.ndarray | None) -> list[list[int]] | None:
    """The tokens of a multi-step decode (``job.steps`` > 1), a list per active lane in lane order
    (each as long as its steps: ``job.seq_steps``); None when the result has no such tokens or a
    lane's last one is not the argmax of the logits row it returned (the device's argmax checked
    against the host's on the row the checksum covers: an output the host cannot trust, handled as
    crosstalk)."""
    if step_tokens is None or step_tokens.ndim != 2 or step_tokens.shape[1] != job.steps:
        return None
    active = job.active
    n = len(active)
    if active[-1] == n - 1:  # ascending: a contiguous prefix is a view
        toks, rows = step_tokens[:n], logits[:n]
    else:
        toks, rows = step_tokens[active], logits[active]
    per = job.seq_steps
    if per is None:
        last = toks[:, -1]
    else:
        last = toks[np.arange(n), np.array(per) - 1]
    if not np.array_equal(last, rows.argmax(axis=1)):
        return None
    out: list[list[int]] = toks.tolist()
    if per is not None:
        out = [r[:k] for r, k in zip(out, per, strict=True)]
    return out


def out_lanes(job: DeviceJob) -> list[int]:
    """The output lanes of ``job`` that carry logits (checked against :func:`expect`)."""
    return list(range(len(job.tokens))) if job.all_logits else job.active


def _lane_sampling(s: Seq, logits: LaneLogits | None = None) -> LaneSampling:
    sp = s.req.sampling
    return LaneSampling(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=s.seed,
                        step=s.generated, logprobs=sp.logprobs, min_p=sp.min_p, logits=logits)


def _lanes(seqs: list[Seq], vocab: int) -> list[LaneSampling]:
    """The lanes' settings; processed requests get their :class:`LaneLogits` (penalty counts
    caught up with their tokens, grammar masks computed together)."""
    if not any(s.req.sampling.processed for s in seqs):
        return [_lane_sampling(s) for s in seqs]
    states = [s.sampling_state for s in seqs]
    procs = lane_logits([s.prompt for s in seqs], [s.req.sampling for s in seqs],
                        [s.tokens for s in seqs], states, vocab)
    for s, st in zip(seqs, states, strict=True):
        s.sampling_state = st
    return [_lane_sampling(s, p) for s, p in zip(seqs, procs, strict=True)]


def sample(job: DeviceJob, seqs: list[Seq], logits: np.ndarray) -> Sampled:
    """One token (and its logprobs when asked) per sequence of ``job``, from its logits rows."""
    if job.kind == "prefill":
        if job.all_logits:  # the whole prompt scored: every position's logits, the last draws
            if not _score_prompt(seqs[0], logits):
                return [SAMPLE_FAILED], [None]
            logits = logits[-1:]
        rows = logits[:1]
    else:
        # Active lanes are ascending: a contiguous prefix is a view, not a fancy-index copy.
        active = job.active
        n = len(active)
        rows = logits[:n] if active[-1] == n - 1 else logits[active]
    if all(map(PLAIN_GREEDY, seqs)):
        # what sample_batch returns for such lanes, minus its setup
        return greedy_argmax(rows), [None] * len(seqs)
    forced = [i for i, s in enumerate(seqs)
              if s.score_upto is not None and s.score_upto < len(s.prompt)]
    if forced:
        return _with_scores(rows, seqs, forced)
    return _draw(rows, seqs)


def _score_prompt(s: Seq, logits: np.ndarray) -> bool:
    """A prefill's every position's logits score the prompt: row i scores ``prompt[i + 1]``
    (appended to ``s.prompt_scores``, after the first token's null entry). False: scoring failed
    (the request ends with an error; the engine carries on)."""
    n = len(s.prompt)
    assert s.prompt_scores is not None and len(s.prompt_scores) == 1 and len(logits) == n
    k = s.req.sampling.prompt_logprobs or 0
    try:
        s.prompt_scores.extend(score_tokens(logits[:n - 1], s.prompt[1:].tolist(), [k] * (n - 1)))
    except Exception:  # defence in depth: NaN logits, a numpy failure
        log.exception("scoring the prompt failed for request %d", s.rid, extra={"request_id": s.rid})
        return False
    return True


def _with_scores(rows: np.ndarray, seqs: list[Seq], forced: list[int]) -> Sampled:
    """:func:`sample` of a job where the lanes ``forced`` score their prompt: their "token" is
    the next prompt token, with its logprob and top alternatives; the others draw as usual."""
    n = len(seqs)
    tokens: list[int] = [SAMPLE_FAILED] * n
    lps: list[TokenLogprob | None] = [None] * n
    fs = set(forced)
    others = [i for i in range(n) if i not in fs]
    if others:
        got, got_lps = _draw(rows[others], [seqs[i] for i in others])
        for i, t, lp in zip(others, got, got_lps, strict=True):
            tokens[i], lps[i] = t, lp
    fseqs = [seqs[i] for i in forced]
    want = [int(s.prompt[s.score_upto or 0]) for s in fseqs]
    ks = [s.req.sampling.prompt_logprobs or 0 for s in fseqs]
    try:
        scores: list[TokenLogprob | None] = list(score_tokens(rows[forced], want, ks))
    except Exception:  # defence in depth: lane by lane, failures alone
        scores = []
        for r, (i, s) in enumerate(zip(forced, fseqs, strict=True)):
            try:
                scores.append(score_tokens(rows[i:i + 1], want[r:r + 1], ks[r:r + 1])[0])
            except Exception:
                log.exception("scoring the prompt failed for request %d", s.rid,
                              extra={"request_id": s.rid})
                scores.append(None)
    for i, sc in zip(forced, scores, strict=True):
        if sc is not None:
            tokens[i], lps[i] = sc.token_id, sc
    return tokens, lps


def _draw(rows: np.ndarray, seqs: list[Seq]) -> Sampled:
    """One drawn token per sequence (the lanes' own settings), lane by lane after a failure."""
    vocab = rows.shape[1]
    try:
        lanes = _lanes(seqs, vocab)
    except Exception:  # defence in depth (a processor failed): lane by lane, failures alone
        return _sample_each(rows, [_one_lane(s, vocab) for s in seqs], [s.rid for s in seqs])
    try:
        res = sample_batch(rows, lanes)
    except Exception:  # defence in depth: one lane's failure must not stop the engine
        return _sample_each(rows, lanes, [s.rid for s in seqs])
    return res.tokens.tolist(), res.logprobs


def _one_lane(s: Seq, vocab: int) -> LaneSampling | None:
    try:
        return _lanes([s], vocab)[0]
    except Exception:
        log.exception("preparing the sampler failed for request %d", s.rid,
                      extra={"request_id": s.rid})
        return None


def _sample_each(rows: np.ndarray, lanes: Sequence[LaneSampling | None], rids: list[int]
                 ) -> Sampled:
    """Sample lane by lane after a batch raised: lanes that raise again (or whose settings could
    not be prepared: None) get :data:`SAMPLE_FAILED` (their requests end with an error), the
    others their token."""
    tokens: list[int] = []
    lps: list[TokenLogprob | None] = []
    for i, ln in enumerate(lanes):
        if ln is None:
            tokens.append(SAMPLE_FAILED)
            lps.append(None)
            continue
        try:
            r = sample_batch(rows[i:i + 1], [ln])
        except Exception:
            log.exception("sampling failed for request %d", rids[i], extra={"request_id": rids[i]})
            tokens.append(SAMPLE_FAILED)
            lps.append(None)
            continue
        tokens.append(int(r.tokens[0]))
        lps.append(r.logprobs[0])
    return tokens, lps
