"""OpenAI response and chunk bodies (completions legacy shape and chat), encoded with msgspec.

finish_reason: the engine's STOP -> "stop", LENGTH -> "length"; DEADLINE -> "length" (the request ran
out of its time budget: a truncation, like running out of tokens; OpenAI has no better value).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from calserve.api.protocol import TokenizerLike
from calserve.engine.types import FinishReason, TokenLogprob, Usage

__all__ = ["new_id", "finish_reason", "LogprobFormatter", "usage_dict", "sse", "DONE"]

_ENC: Final = msgspec.json.Encoder()
DONE: Final = b"data: [DONE]\n\n"

_FINISH: Final = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.DEADLINE: "length",
    FinishReason.CANCELLED: "stop",
    FinishReason.ERROR: "stop",
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now_s() -> int:
    return int(time.time())


def finish_reason(reason: FinishReason) -> str:
    return _FINISH.get(reason, "stop")


def usage_dict(u: Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


def sse(obj: Any) -> bytes:
    """One SSE event: ``data: <json>\\n\\n``."""
    return b"data: " + _ENC.encode(obj) + b"\n\n"


def encode(obj: Any) -> bytes:
    return _ENC.encode(obj)


class LogprobFormatter:
    """Formats engine TokenLogprobs. Token strings are ``decode([id])`` (what OpenAI shows);
    ``text_offset`` is the running sum of those strings' lengths, starting after any echoed prompt."""

    def __init__(self, tok: TokenizerLike, start_offset: int = 0) -> None:
        self._tok = tok
        self._offset = start_offset
        self._cache: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.decode([token_id])
            if len(self._cache) < 65536:
                self._cache[token_id] = s
        return s

    def completion(self, lps: Sequence[TokenLogprob]) -> dict[str, list[Any]]:
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for lp in lps:
            p = self.piece(lp.token_id)
            tokens.append(p)
            v = lp.logprob
            if v != v:  # NaN: a scored prompt's first token, which has no context (OpenAI: null)
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(v)
                tops.append({self.piece(t): v for t, v in lp.top})
            offsets.append(self._offset)
            self._offset += len(p)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def prompt(self, lps: Sequence[TokenLogprob], k: int) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, null for the first (no context), else
        ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt token (its rank among
        the vocabulary) and the ``k`` most likely tokens (ranks 1..k); ids as JSON keys."""
        out: list[dict[str, Any] | None] = []
        for lp in lps:
            if lp.logprob != lp.logprob:  # NaN: the first prompt token
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.piece(lp.token_id)}}
            for r, (t, v) in enumerate(lp.top[:k], start=1):
                entry[str(t)] = {"logprob": v, "rank": r, "decoded_token": self.piece(t)}
            out.append(entry)
        return out

    def chat(self, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        out = []
        for lp in lps:
            p = self.piece(lp.token_id)
            out.append({
                "token": p, "logprob": lp.logprob, "bytes": list(p.encode("utf-8")),
                "top_logprobs": [
                    {"token": (q := self.piece(t)), "logprob": v, "bytes": list(q.encode("utf-8"))}
                    for t, v in lp.top
                ],
            })
        return out


def merge_completion_logprobs(parts: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for p in parts:
        for k, v in p.items():
            out[k].extend(v)
    return out
