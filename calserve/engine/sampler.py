"""Vectorised token sampling for a whole batch (issue 5 item 5, spec §9 SamplerPool).

One call samples every lane of a device batch: the dispatcher hands over the logits matrix
``[n, vocab]`` and one :class:`LaneSampling` per row, and gets back the chosen tokens and the
requested logprobs. Lanes are grouped by kind (greedy / full-vocabulary temperature / top-k /
top-p) and each group is handled by a few numpy operations over all its rows; per lane there is
only Python bookkeeping on scalars (its kind, its uniform, its settings; and the ``TokenLogprob``
objects of the lanes that asked for them), never an operation on its row. A group that is the
whole batch takes the rows as a view; a lone row (the default configuration's B1) takes the same
operations without the batch's row indexing (each such path is checked against the batch's result
for that row). The large temporaries (float64 weights, nucleus buckets, processed logits) are
per-thread scratch buffers: a fresh array of [16, 49k] float64 costs more in page faults than the
arithmetic done in it (bench/README, session 28).

Reproducibility (spec: "same seed + same prompt = same output"): the uniform variate of a lane is a
pure function of ``(seed, step)`` — a splitmix64 hash, counter-based, no generator state — and every
per-row computation (max, softmax normaliser, cumulative sums, candidate selection with exact
tie-breaking) depends only on that row. So a lane's token does not depend on its batch position,
its batch-mates, or the batch size (tests/engine_parts/test_parts_sampler.py pins this).

Logprobs are ``log_softmax`` of the RAW logits (before temperature), as OpenAI reports them: the
chosen token's and the top ``k`` alternatives, highest first, ties broken by lowest token id.

Logits processors (``LaneSampling.logits``: logit bias, repetition / frequency / presence penalties,
the grammar mask; :mod:`calserve.engine.logits`) and ``min_p`` change the logits a lane draws from
(greedy lanes too), batched over the lanes that have them; lanes without any take exactly the
path they took before (same tokens for the same seed).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence
from typing import Final, final

import numpy as np
import numpy.typing as npt

from calserve.engine.fastexp import exp_inplace
from calserve.engine.logits import LaneLogits, apply_processors
from calserve.engine.nucleus import cut, drop_below, nonzero2, nucleus_of_sorted, scratch
from calserve.engine.types import SamplingParams, TokenLogprob

__all__ = ["LaneSampling", "SampleResult", "sample_batch", "score_tokens", "greedy_argmax",
           "resolve_seed", "uniform_for"]

_MASK64: Final = (1 << 64) - 1
_process_rng = np.random.default_rng()
#: Temperatures below this sample greedily.
MIN_TEMPERATURE: Final = 1e-5
_F32: Final = np.dtype(np.float32)


@final
@dataclasses.dataclass(frozen=True)
class LaneSampling:
    """How one lane of a batch is sampled at one decode step.

    ``step`` is the index of the token being produced (0 for the token sampled from the prefill
    logits); together with ``seed`` it fixes the lane's uniform variate. ``seed=None`` draws the
    variate from a process-wide RNG (not reproducible); the engine should rather pin a seed per
    request with :func:`resolve_seed` so that the seed can be logged.
    """

    temperature: float = 0.0  # 0 = greedy (argmax, lowest id on ties)
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None
    step: int = 0
    logprobs: int | None = None  # None = none; k >= 0: chosen token's + top-k alternatives
    min_p: float = 0.0  # [0, 1]: keep tokens with p >= min_p * p_max (after temperature)
    logits: LaneLogits | None = dataclasses.field(default=None, compare=False)  # processors
    # Derived: the lane's logits are changed before its draw (min_p or a processor).
    processed: bool = dataclasses.field(init=False, default=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "processed", self.logits is not None or self.min_p > 0.0)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"LaneSampling.min_p must be in [0, 1], got {self.min_p!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"LaneSampling.temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"LaneSampling.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"LaneSampling.top_k must be >= 0, got {self.top_k!r}")
        if self.step < 0:
            raise ValueError(f"LaneSampling.step must be >= 0, got {self.step!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"LaneSampling.logprobs must be None or >= 0, got {self.logprobs!r}")

    @classmethod
    def from_params(cls, params: SamplingParams, *, step: int, seed: int | None = None) -> LaneSampling:
        """The lane settings of a request at ``step``; ``seed`` overrides ``params.seed``
        (pass the request's resolved seed)."""
        return cls(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed if seed is None else seed,
            step=step,
            logprobs=params.logprobs,
            min_p=params.min_p,
        )


@final
@dataclasses.dataclass(frozen=True)
class SampleResult:
    tokens: npt.NDArray[np.int64]  # [n]: the chosen token of each lane
    logprobs: list[TokenLogprob | None]  # [n]: None where the lane asked for none


def resolve_seed(seed: int | None) -> int:
    """A request's effective seed: its own, or a fresh random one (so even unseeded requests can be
    replayed from the logs)."""
    return secrets.randbits(63) if seed is None else seed


_GOLDEN: Final = 0x9E3779B97F4A7C15
_MIX1: Final = 0xBF58476D1CE4E5B9
_MIX2: Final = 0x94D049BB133111EB


def _splitmix64(x: int) -> int:
    """splitmix64's finaliser of ``x`` (an int in [0, 2**64)), wrapping as uint64 arithmetic does.
    On Python ints: a batch has a handful of lanes, and numpy's per-call cost for one-element
    arrays was ~16 % of a small sampled step."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def uniform_for(seed: int, step: int) -> float:
    """The uniform variate in [0, 1) a seeded lane uses at ``step``: a pure function of ``(seed,
    step)`` (counter-based, no state; seeds and steps taken mod 2**64). The top 53 bits of the
    hash over 2**53: exact in float64."""
    h = _splitmix64((seed & _MASK64) ^ _splitmix64(step & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def _pad_blocks(x: npt.NDArray[np.floating], block: int, fill: float) -> npt.NDArray[np.floating]:
    """View ``x`` [m, v] as [m, nb, block], padding the last block with ``fill``."""
    m, v = x.shape
    nb = -(-v // block)
    if nb * block != v:
        x = np.concatenate([x, np.full((m, nb * block - v), fill, dtype=x.dtype)], axis=1)
    return x.reshape(m, nb, block)


def _block_max(x: npt.NDArray[np.floating], block: int) -> npt.NDArray[np.floating]:
    """The maximum of each ``block`` columns of each row (the last block may be shorter): the
    values of ``_pad_blocks(x, block, -inf).max(axis=2)`` without its padded copy of ``x``."""
    m, v = x.shape
    whole = v // block
    out: npt.NDArray[np.floating] = x[:, : whole * block].reshape(m, whole, block).max(axis=2)
    if whole * block == v:
        return out
    return np.concatenate([out, x[:, whole * block:].max(axis=1)[:, None]], axis=1)


def _top_sorted(x: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    """Ids of the ``k`` largest values of each row, highest first, ties broken by lowest id.

    Exact and row-local, without sorting the vocabulary: split each row into ~4k blocks; the k-th
    largest block maximum ``t`` is a lower bound of the k-th largest value (k blocks each hold a
    value >= t), so every top-k token, ties included, satisfies ``x >= t``. Only those candidates
    (typically a few k) are sorted by (value desc, id asc).
    """
    m, v = x.shape
    k = max(1, min(k, v))
    if 8 * k >= v:
        return np.argsort(-x, axis=1, kind="stable")[:, :k].astype(np.int64)
    block = max(1, v // (4 * k))
    bmax = _block_max(x, block)
    nb = bmax.shape[1]
    thr = np.partition(bmax, nb - k, axis=1)[:, nb - k]
    rows, cols = nonzero2(x >= thr[:, None])
    counts = np.bincount(rows, minlength=m)
    starts = np.cumsum(counts) - counts
    slot = np.arange(rows.size) - starts[rows]
    width = int(counts.max())
    ids = np.full((m, width), v, dtype=np.int64)  # padding sorts last: value -inf, id v
    vals = np.full((m, width), -np.inf, dtype=np.float32)
    ids[rows, slot] = cols
    vals[rows, slot] = x[rows, cols]
    order = np.lexsort((ids, -vals), axis=-1)[:, :k]
    out: npt.NDArray[np.int64] = np.take_along_axis(ids, order, axis=1)
    return out


_DRAW_BLOCK: Final = 256

# The kinds of lane a batch is split into (each drawn by a few numpy operations over its rows).
_GREEDY, _FULL, _TOP_K, _TOP_P = range(4)


def _kind(ln: LaneSampling, vocab: int) -> int:
    if ln.temperature < MIN_TEMPERATURE:
        # A temperature this small is greedy (as vLLM's epsilon): dividing the logits by a
        # subnormal overflows to inf (issue 12); convert.py maps such values to 0 before here.
        return _GREEDY
    if 0 < ln.top_k < vocab:
        return _TOP_K
    return _TOP_P if ln.top_p < 1.0 else _FULL


def _exp_shifted(rows: npt.NDArray[np.float32], temps: npt.NDArray[np.float64],
                 rowmax: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float64]:
    """``exp(x/T - max(x/T))`` per row in float64, computed in place in the sampler's scratch
    buffer (:func:`~calserve.engine.nucleus.scratch`): at [16, 32k] a fresh float64 temporary
    costs more in page faults than the arithmetic itself.
    ``x / 1.0 == x`` exactly, so a batch whose temperatures are all 1 (OpenAI's default, and the
    logprobs' raw softmax) skips the division: ~20 % of this function at [16, 49k]. ``rowmax``:
    ``rows.max(axis=1)`` when the caller has it. The result is valid until the next call."""
    s = scratch(rows.shape, np.float64, "weights")
    s[...] = rows
    if not (temps == 1.0).all():
        s /= temps[:, None]
    if rowmax is None:
        rowmax = rows.max(axis=1)
    s -= (rowmax.astype(np.float64) / temps)[:, None]
    exp_inplace(s)  # numpy.exp's bits, vectorised where numpy is not (engine/fastexp.py)
    return s


def _draw_id_order(e: npt.NDArray[np.float64], u: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """Inverse-CDF draw over non-negative weights ``e`` [m, v] in token-id order.

    Two-level search (block sums, then one block) instead of a cumsum over the vocabulary, which
    is several times slower than a sum in numpy. Every row needs some positive weight."""
    m, _ = e.shape
    eb = _pad_blocks(e, _DRAW_BLOCK, 0.0)
    if m == 1:
        return _draw_one(eb[0], u[0])
    bsum = eb.sum(axis=2)
    bcdf = np.cumsum(bsum, axis=1)
    target = u * bcdf[:, -1]
    last_block = bsum.shape[1] - 1 - np.argmax(bsum[:, ::-1] > 0.0, axis=1)
    b = np.minimum(np.count_nonzero(bcdf <= target[:, None], axis=1), last_block)
    r = np.arange(m)
    before = np.where(b > 0, bcdf[r, np.maximum(b - 1, 0)], 0.0)
    blk = eb[r, b]  # [m, block]
    icdf = np.cumsum(blk, axis=1)
    j = np.count_nonzero(icdf <= (target - before)[:, None], axis=1)
    # Rounding between the block sum and its cumsum: fall back to the block's last non-zero token.
    last_pos = blk.shape[1] - 1 - np.argmax(blk[:, ::-1] > 0.0, axis=1)
    out: npt.NDArray[np.int64] = (b * _DRAW_BLOCK + np.minimum(j, last_pos)).astype(np.int64)
    return out


def _draw_one(eb: npt.NDArray[np.float64], u: float) -> npt.NDArray[np.int64]:
    """:func:`_draw_id_order` of one row, already in blocks (``[nb, block]``): the same operations
    on the row's values in the same order (each block's sum reduces its contiguous ``block``
    values as the batch's does; the rest are scalars), without the batch's row indexing — the
    default configuration (B1) samples every token this way."""
    bsum = eb.sum(axis=1)
    bcdf = np.cumsum(bsum)
    target = u * bcdf[-1]
    last_block = bsum.shape[0] - 1 - int(np.argmax(bsum[::-1] > 0.0))
    b = min(int(np.count_nonzero(bcdf <= target)), last_block)
    before = bcdf[b - 1] if b > 0 else 0.0
    blk = eb[b]
    j = int(np.count_nonzero(np.cumsum(blk) <= target - before))
    last_pos = blk.shape[0] - 1 - int(np.argmax(blk[::-1] > 0.0))
    return np.array([b * _DRAW_BLOCK + min(j, last_pos)], dtype=np.int64)


def _draw_top_k(
    rows: npt.NDArray[np.float32],
    temps: npt.NDArray[np.float64],
    top_k: npt.NDArray[np.int64],
    top_p: npt.NDArray[np.float64],
    u: npt.NDArray[np.float64],
    min_p: npt.NDArray[np.float64] | None = None,
) -> npt.NDArray[np.int64]:
    """Top-k, then top-p on the renormalised top-k distribution (as vLLM does). ``min_p`` drops
    the candidates below min_p x the best one's probability first (the top-k holds the best token,
    so this is exactly min-p over the vocabulary, then top-k)."""
    m, vocab = rows.shape
    k_eff = np.minimum(top_k, vocab)
    width = int(k_eff.max())
    ids = _top_sorted(rows, width)
    # max(x / T) == max(x) / T exactly (rounding is monotone), so no full-row division is needed.
    smax = (rows.max(axis=1).astype(np.float64) / temps)[:, None]
    cand = np.exp(np.take_along_axis(rows, ids, axis=1).astype(np.float64) / temps[:, None] - smax)
    cand = np.where(np.arange(width)[None, :] < k_eff[:, None], cand, 0.0)
    if min_p is not None:  # the best candidate's weight is exp(0) = 1
        cand = np.where(cand >= min_p[:, None], cand, 0.0)
    q = cand / cand.sum(axis=1, keepdims=True)
    keep = nucleus_of_sorted(q, top_p, np.zeros(m))
    # Draw in token-id order over the kept set (the same rule as every other path).
    by_id = np.argsort(np.where(keep, ids, vocab), axis=1, kind="stable")
    w = np.take_along_axis(np.where(keep, q, 0.0), by_id, axis=1)
    j = _draw_id_order(w, u)
    chosen: npt.NDArray[np.int64] = np.take_along_axis(ids, by_id, axis=1)[np.arange(m), j]
    return chosen


def _softmax_sums(e: npt.NDArray[np.float64], idx: list[int], sel: list[LaneSampling],
                  into: dict[int, float]) -> None:
    """The raw softmax normalisers the logprobs need, from a full-vocabulary draw's weights ``e``
    of lanes ``idx`` (settings ``sel``) on unprocessed logits: for a lane at temperature 1 whose
    weights min-p left whole they are exactly the row sums the logprobs compute (``x / 1.0 == x``,
    the same exp, the same pairwise sum of the same row), so OpenAI's default request with
    logprobs pays one exp over the vocabulary, not two."""
    keep = [k for k, ln in enumerate(sel)
            if ln.logprobs is not None and ln.temperature == 1.0 and ln.min_p == 0.0]
    if keep:
        rows = e if len(keep) == len(sel) else e[keep]
        for k, z in zip(keep, rows.sum(axis=1).tolist(), strict=True):
            into[idx[k]] = z


def _draw_nucleus(
    rows: npt.NDArray[np.float32],
    temps: npt.NDArray[np.float64],
    top_p: npt.NDArray[np.float64],
    u: npt.NDArray[np.float64],
    min_p: npt.NDArray[np.float64] | None = None,
) -> npt.NDArray[np.int64]:
    """Top-p over the whole vocabulary (no top-k), after min-p when given."""
    e = _exp_shifted(rows, temps)
    if min_p is not None:
        drop_below(e, min_p)
    cut(e, top_p, rows)  # weights outside the top-p set to 0 (engine/nucleus.py)
    return _draw_id_order(e, u)


def greedy_argmax(x: npt.NDArray[np.float32]) -> list[int]:
    """Greedy tokens of every row of ``x`` ([n, vocab] float32), lowest id on ties, as Python ints,
    with :func:`sample_batch`'s row check: ``x[i, argmax]`` is the row's max, NaN included (argmax
    stops at the first NaN), so a row is rejected exactly when its max is not finite.

    The all-greedy fast path (the common decode step): one argmax call, no per-kind masks; the
    dispatcher calls it directly when no lane needs more than the argmax."""
    if x.dtype is not _F32 and x.dtype != _F32:  # identity first: the common case is one pointer test
        x = x.astype(np.float32)
    toks: list[int] = x.argmax(axis=1).tolist()
    for i, t in enumerate(toks):
        if not math.isfinite(x[i, t]):
            raise ValueError(f"logits row {i} (lane {i}) is NaN or has no finite value")
    return toks


def sample_batch(logits: np.ndarray, lanes: Sequence[LaneSampling]) -> SampleResult:
    """Sample one token for every row of ``logits`` ([n, vocab] float32) with ``lanes[i]``'s rules.

    A lane's processors (``lane.logits``: bias, penalties, grammar mask) change its logits first.
    Greedy lanes (temperature 0) then take the argmax, lowest id on ties. Other lanes divide by the
    temperature, apply min-p, top-k, then top-p (keeping at least one token), and draw by inverse
    CDF with their counter-based uniform. Logprobs are always those of the raw logits. Raises ValueError naming the lane for NaN or an
    all ``-inf`` row, or a shape mismatch.
    """
    x = np.asarray(logits)
    if x.ndim != 2:
        raise ValueError(f"logits must be 2-D [n, vocab], got shape {x.shape}")
    n, vocab = x.shape
    if n != len(lanes):
        raise ValueError(f"logits has {n} rows but {len(lanes)} lanes were given")
    if vocab < 1:
        raise ValueError("logits has an empty vocabulary axis")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if n == 0:
        return SampleResult(tokens=np.zeros(0, dtype=np.int64), logprobs=[])
    if all(ln.temperature == 0.0 and ln.logprobs is None and not ln.processed for ln in lanes):
        return SampleResult(tokens=np.array(greedy_argmax(x), dtype=np.int64), logprobs=[None] * n)
    tokens = np.zeros(n, dtype=np.int64)
    raw = x  # logprobs are those of the raw logits
    sums: dict[int, float] = {}  # lane -> its raw softmax normaliser, when a draw had it
    if any(ln.logits is not None for ln in lanes):
        # Processors add finite values or -inf: a NaN or non-finite raw row stays one, and the
        # row check below catches it (and a row the grammar mask bans entirely).
        x = apply_processors(x, [ln.logits for ln in lanes], out=scratch(x.shape, np.float32, "processed"))
    rowmax = x.max(axis=1)
    bad = ~np.isfinite(rowmax)  # max propagates NaN; -inf means the row has no finite value
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"logits row {i} (lane {i}) is NaN or has no finite value")

    # The lanes' kinds and settings as Python values, per kind as arrays of its lanes (a batch has
    # a handful of lanes: numpy's per-call cost on one-element masks was most of a small step).
    kinds = [_kind(ln, vocab) for ln in lanes]
    greedy = [i for i, k in enumerate(kinds) if k == _GREEDY]
    if greedy:
        tokens[greedy] = np.argmax(x[greedy], axis=1)
    if len(greedy) < n:
        u = [None if ln.seed is None else uniform_for(ln.seed, ln.step) for ln in lanes]
        unseeded = [i for i, v in enumerate(u) if v is None]
        if unseeded:
            for i, v in zip(unseeded, _process_rng.random(len(unseeded)).tolist(), strict=True):
                u[i] = v
        for kind in (_FULL, _TOP_K, _TOP_P):
            idx = [i for i, k in enumerate(kinds) if k == kind]
            if not idx:
                continue
            # A kind every lane has takes the rows as they are (a slice: views, no copy).
            t = slice(None) if len(idx) == n else np.array(idx, dtype=np.intp)
            sel = [lanes[i] for i in idx]
            temps = np.array([ln.temperature for ln in sel], dtype=np.float64)
            uk = np.array([u[i] for i in idx], dtype=np.float64)
            # min-p works on each draw's own weights, before top-k / top-p (0: no-op)
            mp = np.array([ln.min_p for ln in sel], dtype=np.float64) if any(
                ln.min_p > 0.0 for ln in sel) else None
            if kind == _FULL:
                e = _exp_shifted(x[t], temps, rowmax[t])
                if mp is not None:
                    drop_below(e, mp)
                tokens[t] = _draw_id_order(e, uk)
                if x is raw:
                    _softmax_sums(e, idx, sel, sums)
            elif kind == _TOP_K:
                tokens[t] = _draw_top_k(x[t], temps, np.array([ln.top_k for ln in sel], np.int64),
                                        np.array([ln.top_p for ln in sel], np.float64), uk, mp)
            else:
                tokens[t] = _draw_nucleus(x[t], temps,
                                          np.array([ln.top_p for ln in sel], np.float64), uk, mp)

    out_lp: list[TokenLogprob | None] = [None] * n
    want = [i for i, ln in enumerate(lanes) if ln.logprobs is not None]
    if want:
        unprocessed = x is raw  # rowmax is then the raw rows' maximum too
        x = raw
        if len(want) == n:  # every lane: the rows themselves, not a copy of them
            w = np.arange(n, dtype=np.int64)
            xw = x
            wmax = rowmax if unprocessed else x.max(axis=1)
        else:
            w = np.array(want, dtype=np.int64)
            xw = x[w]
            wmax = rowmax[w] if unprocessed else xw.max(axis=1)
        if all(i in sums for i in want):  # temperature 1, full vocabulary: the draw's weights
            z = np.array([sums[i] for i in want], dtype=np.float64)
        else:
            z = _exp_shifted(xw, np.ones(len(w)), wmax).sum(axis=1)
        lse = wmax.astype(np.float64) + np.log(z)
        got = _token_logprobs(xw, lse, tokens[w], [lanes[i].logprobs or 0 for i in want])
        for r, i in enumerate(want):
            out_lp[i] = got[r]
    return SampleResult(tokens=tokens, logprobs=out_lp)


def _token_logprobs(xw: npt.NDArray[np.float32], lse: npt.NDArray[np.float64],
                    tokens: npt.NDArray[np.int64], ks: Sequence[int]) -> list[TokenLogprob]:
    """Row ``r``'s ``tokens[r]`` and its ``ks[r]`` most likely tokens as raw logprobs, given each
    row's log-sum-exp ``lse``."""
    vocab = xw.shape[1]
    chosen = xw[np.arange(len(xw)), tokens].astype(np.float64) - lse
    kmax = max(ks, default=0)
    top_ids = _top_sorted(xw, min(kmax, vocab)) if kmax > 0 else np.zeros((len(xw), 0), np.int64)
    top_lp = np.take_along_axis(xw, top_ids, axis=1).astype(np.float64) - lse[:, None]
    out = []
    for r, k in enumerate(ks):
        k = min(k, vocab)
        out.append(TokenLogprob(
            token_id=int(tokens[r]),
            logprob=float(chosen[r]),
            top=tuple(zip(top_ids[r, :k].tolist(), top_lp[r, :k].tolist(), strict=True)),
        ))
    return out


def score_tokens(logits: np.ndarray, tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """The raw logprob of ``tokens[r]`` under row ``r`` of ``logits`` ([n, vocab]) with the row's
    ``ks[r]`` most likely tokens and its rank (1 + the tokens scored higher): what a prompt token scores (``echo`` with ``logprobs``), the
    same numbers :func:`sample_batch` gives a drawn token. Raises ValueError on NaN logits."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    if x.ndim != 2 or len(x) != len(tokens) or len(tokens) != len(ks):
        raise ValueError("score_tokens takes [n, vocab] logits and n tokens and n ks")
    if len(x) == 0:
        return []
    if np.isnan(x).any():
        raise ValueError("NaN in the logits")
    wmax = x.max(axis=1)
    z = _exp_shifted(x, np.ones(len(x)), wmax).sum(axis=1)
    lse = wmax.astype(np.float64) + np.log(z)
    ids = np.asarray(tokens, np.int64)
    ranks = 1 + (x > x[np.arange(len(x)), ids][:, None]).sum(axis=1)
    return [dataclasses.replace(lp, rank=int(r))
            for lp, r in zip(_token_logprobs(x, lse, ids, ks), ranks.tolist(), strict=True)]
