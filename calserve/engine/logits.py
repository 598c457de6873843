"""Logits processors of the batched sampler: logit bias, repetition / frequency / presence penalties
and the grammar mask, applied to a whole batch with a few numpy operations (no per-lane numpy call).

Meaning (OpenAI's, as vLLM implements it; the order is vLLM's too):

1. ``logit_bias``: ``x[t] += bias[t]`` (bias in [-100, 100]; -100 bans a token in practice);
2. ``repetition_penalty`` p over the tokens seen in the prompt *or* generated (each once): a
   positive logit is divided by p, a negative one multiplied by p (p > 1 discourages repeats);
3. ``frequency_penalty`` f and ``presence_penalty`` r over the *generated* tokens:
   ``x[t] -= f * count[t] + r * (count[t] > 0)``;
4. the grammar mask of constrained decoding (``response_format``): tokens the grammar does not
   allow next get ``-inf`` (EOS is allowed only where the grammar may end).

``min_p`` needs the temperature and lives in the sampler (:mod:`calserve.engine.sampler`).

State: a request's counts are a function of its generated tokens (``Seq.tokens``), which the
request already keeps for re-prefill after a device fault. :class:`LaneHistory` catches up with
that list before every draw (O(1) per new token: numpy arrays with a slot per distinct token), and
starts over if it ever sees a shorter list, so the penalties after a re-prefill are exactly those of
a fault-free run. Logprobs stay those of the raw logits (the sampler keeps them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final, final

import numpy as np
import numpy.typing as npt

from calserve.engine.grammar import GrammarState, fill_masks
from calserve.engine.nucleus import apply_masks
from calserve.engine.types import SamplingParams

__all__ = ["LaneLogits", "LaneHistory", "SeqSamplingState", "apply_processors", "lane_logits"]

_NO_IDS: Final = np.zeros(0, dtype=np.int64)
_NO_VALS: Final = np.zeros(0, dtype=np.float32)


@final
@dataclasses.dataclass(frozen=True, eq=False)
class LaneLogits:
    """What one lane's logits need before the draw (all optional; arrays are read, never written)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bias_ids: npt.NDArray[np.int64] = dataclasses.field(default_factory=lambda: _NO_IDS)  # unique
    bias_vals: npt.NDArray[np.float32] = dataclasses.field(default_factory=lambda: _NO_VALS)
    # distinct generated tokens and their counts
    hist_ids: npt.NDArray[np.int64] = dataclasses.field(default_factory=lambda: _NO_IDS)
    hist_counts: npt.NDArray[np.float32] = dataclasses.field(default_factory=lambda: _NO_VALS)
    # distinct prompt + generated tokens (repetition penalty)
    seen_ids: npt.NDArray[np.int64] = dataclasses.field(default_factory=lambda: _NO_IDS)
    allowed: npt.NDArray[np.int32] | None = None  # grammar bitmask row (bit t of word t // 32)

    @classmethod
    def from_history(cls, generated: Sequence[int], prompt: Sequence[int] = (), *,
                     presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                     repetition_penalty: float = 1.0, logit_bias: Sequence[tuple[int, float]] = (),
                     allowed: npt.NDArray[np.int32] | None = None) -> LaneLogits:
        """The lane settings after ``generated`` (tests and tools; the engine keeps a
        :class:`LaneHistory` per request instead of recounting)."""
        h = LaneHistory(np.asarray(prompt, np.int64), repetition_penalty != 1.0)
        h.sync(list(generated))
        bias_ids, bias_vals = _bias_arrays(logit_bias)
        return cls(presence_penalty, frequency_penalty, repetition_penalty, bias_ids, bias_vals,
                   h.ids[:h.n], h.counts[:h.n], h.seen[:h.n_seen], allowed)


def _bias_arrays(bias: Sequence[tuple[int, float]]) -> tuple[npt.NDArray[np.int64],
                                                             npt.NDArray[np.float32]]:
    if not bias:
        return _NO_IDS, _NO_VALS
    return (np.array([t for t, _ in bias], dtype=np.int64),
            np.array([b for _, b in bias], dtype=np.float32))


@final
class LaneHistory:
    """Distinct generated tokens with their counts (and, for the repetition penalty, the distinct
    tokens of prompt + generated), caught up from the request's token list."""

    __slots__ = ("consumed", "_slot", "ids", "counts", "n", "seen", "n_seen", "_prompt", "_rep",
                 "_prompt_ids")

    def __init__(self, prompt: npt.NDArray[np.int64], repetition: bool) -> None:
        self._rep = repetition
        self._prompt_ids = np.unique(prompt) if repetition else _NO_IDS
        self._prompt: frozenset[int] = frozenset(self._prompt_ids.tolist())
        self._reset()

    def _reset(self) -> None:
        self.consumed = 0
        self._slot: dict[int, int] = {}
        self.ids = np.zeros(16, dtype=np.int64)
        self.counts = np.zeros(16, dtype=np.float32)
        self.n = 0
        self.seen = np.concatenate([self._prompt_ids, np.zeros(16, np.int64)])
        self.n_seen = len(self._prompt_ids)

    def sync(self, tokens: Sequence[int]) -> None:
        """Count the tokens generated since the last call (all of them after a shorter list)."""
        if len(tokens) < self.consumed:
            self._reset()
        for t in tokens[self.consumed:]:
            j = self._slot.get(t)
            if j is None:
                j = self._slot[t] = self.n
                if j == len(self.ids):
                    self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                    self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
                self.ids[j] = t
                self.n += 1
                if self._rep and t not in self._prompt:
                    if self.n_seen == len(self.seen):
                        self.seen = np.concatenate([self.seen, np.zeros_like(self.seen)])
                    self.seen[self.n_seen] = t
                    self.n_seen += 1
            self.counts[j] += 1.0
        self.consumed = len(tokens)


@final
class SeqSamplingState:
    """A request's processor state (``Seq.sampling_state``): its history, bias arrays, grammar."""

    __slots__ = ("params", "history", "bias_ids", "bias_vals", "grammar", "allowed")

    def __init__(self, prompt: npt.NDArray[Any], params: SamplingParams, vocab: int = 0) -> None:
        self.params = params
        penal = (params.presence_penalty or params.frequency_penalty
                 or params.repetition_penalty != 1.0)
        self.history = (LaneHistory(np.asarray(prompt, np.int64), params.repetition_penalty != 1.0)
                        if penal else None)
        self.bias_ids, self.bias_vals = _bias_arrays(params.logit_bias)
        self.grammar: GrammarState | None = (params.grammar.new_state()
                                             if params.grammar is not None else None)
        # allowed_token_ids as a mask row like the grammar's (bit t % 32 of word t // 32)
        self.allowed: npt.NDArray[np.int32] | None = (
            _id_mask(params.allowed_token_ids, vocab) if params.allowed_token_ids else None)

    def lane(self, tokens: Sequence[int], allowed: npt.NDArray[np.int32] | None) -> LaneLogits:
        """``allowed``: the grammar's mask row this step (None: no grammar)."""
        p = self.params
        h = self.history
        if self.allowed is not None:  # both: a token must pass both
            allowed = self.allowed if allowed is None else np.bitwise_and(allowed, self.allowed)
        if h is None:
            return LaneLogits(bias_ids=self.bias_ids, bias_vals=self.bias_vals, allowed=allowed)
        h.sync(tokens)
        return LaneLogits(p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                          self.bias_ids, self.bias_vals, h.ids[:h.n], h.counts[:h.n],
                          h.seen[:h.n_seen], allowed)


def lane_logits(prompts: Sequence[npt.NDArray[Any]], params: Sequence[SamplingParams],
                tokens: Sequence[list[int]], states: list[Any], vocab: int
                ) -> list[LaneLogits | None]:
    """The :class:`LaneLogits` of a batch's lanes (None: nothing to process). ``states`` holds
    each request's :class:`SeqSamplingState` (None entries are made here, in place); the grammar
    lanes' masks are computed together (one call into the grammar library)."""
    out: list[LaneLogits | None] = [None] * len(params)
    gram: list[tuple[int, GrammarState]] = []
    for i, sp in enumerate(params):
        if not sp.processed:
            continue
        st = states[i]
        if st is None:
            st = states[i] = SeqSamplingState(prompts[i], sp, vocab)
        if st.grammar is not None:
            st.grammar.sync(tokens[i])
            gram.append((i, st.grammar))
    masks = fill_masks([g for _, g in gram], vocab) if gram else None
    mask_of = {i: k for k, (i, _) in enumerate(gram)}
    for i, sp in enumerate(params):
        if sp.processed:
            k = mask_of.get(i)
            out[i] = states[i].lane(tokens[i], None if masks is None or k is None else masks[k])
    return out


def _id_mask(ids: Sequence[int], vocab: int) -> npt.NDArray[np.int32]:
    """The bitmask row (``ceil(vocab / 32)`` int32 words) allowing exactly ``ids``."""
    bits = np.zeros(-(-vocab // 32) * 32, np.uint8)
    bits[np.asarray(ids, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def _gather(idx: list[int], arrays: list[npt.NDArray[Any]]) -> tuple[npt.NDArray[np.int64],
                                                                      npt.NDArray[Any]]:
    """(row of every element, the arrays concatenated)."""
    sizes = [a.size for a in arrays]
    return np.repeat(np.asarray(idx, np.int64), sizes), np.concatenate(arrays)


def apply_processors(x: npt.NDArray[np.float32], procs: Sequence[LaneLogits | None],
                     out: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
    """A processed copy of ``x`` [n, vocab] (rows with None are unchanged), in ``out`` when given
    (a buffer of the same shape the caller reuses)."""
    if out is None:
        x = x.copy()
    else:
        np.copyto(out, x)
        x = out
    live = [(i, p) for i, p in enumerate(procs) if p is not None]
    bias = [(i, p) for i, p in live if p.bias_ids.size]
    if bias:
        r, c = _gather([i for i, _ in bias], [p.bias_ids for _, p in bias])
        x[r, c] += np.concatenate([p.bias_vals for _, p in bias])
    rep = [(i, p) for i, p in live if p.repetition_penalty != 1.0 and p.seen_ids.size]
    if rep:
        r, c = _gather([i for i, _ in rep], [p.seen_ids for _, p in rep])
        pen = np.repeat(np.array([p.repetition_penalty for _, p in rep], np.float32),
                        [p.seen_ids.size for _, p in rep])
        v = x[r, c]
        x[r, c] = np.where(v > 0, v / pen, v * pen)
    fp = [(i, p) for i, p in live
          if (p.frequency_penalty or p.presence_penalty) and p.hist_ids.size]
    if fp:
        r, c = _gather([i for i, _ in fp], [p.hist_ids for _, p in fp])
        sizes = [p.hist_ids.size for _, p in fp]
        cnt = np.concatenate([p.hist_counts for _, p in fp])
        f = np.repeat(np.array([p.frequency_penalty for _, p in fp], np.float32), sizes)
        pr = np.repeat(np.array([p.presence_penalty for _, p in fp], np.float32), sizes)
        x[r, c] -= f * cnt + pr
    masked = [(i, p.allowed) for i, p in live if p.allowed is not None]
    if masked:
        apply_masks(x, [i for i, _ in masked], [a for _, a in masked])
    return x
