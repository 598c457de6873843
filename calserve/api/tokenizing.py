"""Bounded prompt work for the HTTP layer: a size cap before tokenizing, and a worker thread for
big bodies (README "Per-request limits and slow readers").

Why: decoding, validating, rendering and tokenizing a body is work proportional to what the client
sent. On the trio thread a ~1 MiB prompt (``"a b " * 261000``) took 0.74 s, during which no stream
of any other client moved. So:

- a text is refused (400 naming the field, "context length exceeded") before it is tokenized when
  it has more characters than the model's context can possibly hold, ``max_seq`` x the longest
  token of the vocabulary (:func:`max_text_chars`: exact for byte-level BPE without a normalizer,
  where every token covers at most that many bytes of the text; other tokenizers get no cap and
  rely on the worker);
- bodies over :data:`INLINE_BODY_BYTES` are decoded and prepared in one worker thread of the
  process's own (:func:`run_in_worker`, a ``CapacityLimiter`` of 1 per trio run, apart from trio's
  shared default), with the HF tokenizer's batch call that releases the GIL (:func:`encode_text`),
  so the trio thread keeps running. Small bodies, nearly every request, stay inline: a thread hop
  costs more than tokenizing a few hundred characters.

Cancellation: ``trio.to_thread.run_sync`` (``abandon_on_cancel=False``) either never starts the job
(cancelled while waiting for the limiter) or waits for it (the limiter slot comes back when it
ends) and :func:`run_in_worker` then raises ``Cancelled``; a job only computes (it holds nothing of
the engine), so its result is simply dropped.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Final, TypeVar

import trio
from tokenizers import pre_tokenizers

from calserve import errors as E
from calserve.api.protocol import TokenizerLike
from calserve.models.tokenizer import Tokenizer

__all__ = ["INLINE_BODY_BYTES", "WORKER_THREADS", "encode_text", "max_text_chars",
           "check_text_fits", "run_in_worker", "worker_limiter"]

T = TypeVar("T")

#: Bodies up to this many bytes are decoded and tokenized on the trio thread (at most ~1 ms).
INLINE_BODY_BYTES: Final = 4096
#: Worker threads for big bodies: one, so that big prompts take at most one core from the device
#: and the trio thread however many arrive (they queue for it).
WORKER_THREADS: Final = 1

_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("calserve_prompt_worker")
# tokenizer -> the most characters one of its tokens covers (None: unknown); computed once.
_TOKEN_CHARS: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def worker_limiter() -> trio.CapacityLimiter:
    """The prompt worker's limiter of this trio run (made on first use)."""
    try:
        return _LIMITER.get()
    except LookupError:
        lim = trio.CapacityLimiter(WORKER_THREADS)
        _LIMITER.set(lim)
        return lim


async def run_in_worker(fn: Callable[[], T]) -> T:
    """``fn()`` in the prompt worker thread (see the module docstring for cancellation)."""
    out = await trio.to_thread.run_sync(fn, limiter=worker_limiter())
    # Cancelled while it ran: ``run_sync`` still returns the value; raise here, so a caller whose
    # client is gone does not go on to submit the prepared request.
    await trio.lowlevel.checkpoint_if_cancelled()
    return out


def encode_text(tok: TokenizerLike, text: str, prompt: bool = False) -> tuple[int, ...]:
    """``tok.encode(text)`` as a tuple of ints. For the package tokenizer the HF batch call, which
    releases the GIL while it runs (same ids: ``Tokenizer.encode`` adds no special tokens), and
    for a whole ``prompt`` BOS first when the model expects it (``Tokenizer.with_bos``)."""
    if isinstance(tok, Tokenizer):
        ids = tok.backend.encode_batch([text], add_special_tokens=False)[0].ids
        return tuple(tok.with_bos(ids) if prompt else ids)
    return tuple(int(t) for t in tok.encode(text))


def _token_chars(tok: TokenizerLike) -> int | None:
    if not isinstance(tok, Tokenizer):
        return None
    try:
        return _TOKEN_CHARS[tok]
    except KeyError:
        pass
    hf = tok.backend
    n: int | None = None
    # Exact only when the text reaches the model unchanged and whole (no normalizer; byte-level
    # pre-tokenizer: every byte is covered by a token, one vocabulary character per byte).
    if hf.normalizer is None and isinstance(hf.pre_tokenizer, pre_tokenizers.ByteLevel):
        n = max((len(t) for t in hf.get_vocab(with_added_tokens=True)), default=None)
    _TOKEN_CHARS[tok] = n
    return n


def max_text_chars(tok: TokenizerLike, max_seq: int) -> int | None:
    """The most characters a text can have and still fit in ``max_seq`` tokens (None: no cap
    known for this tokenizer). A token covers at most ``L`` bytes of the text (the longest
    vocabulary entry) and a character is at least one byte, so ``n`` characters need at least
    ``n / L`` tokens."""
    n = _token_chars(tok)
    return None if n is None else max_seq * n


def check_text_fits(tok: TokenizerLike, max_seq: int, n_chars: int, param: str,
                    what: str = "the prompt") -> None:
    """400 ("context length exceeded", naming ``param``) when ``n_chars`` characters cannot fit."""
    cap = max_text_chars(tok, max_seq)
    if cap is not None and n_chars > cap:
        raise E.RequestError(
            f"This model's maximum context length is {max_seq} tokens; {what} has {n_chars}"
            f" characters, more than {max_seq} tokens of this tokenizer can hold ({cap})"
            " (context length exceeded)", param=param)
