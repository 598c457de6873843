"""llama.cpp's ``/infill``: fill-in-the-middle for editor plugins (llama.vscode, llama.vim), in
llama-server's request and answer shapes, on a model with FIM tokens (``models/fim.py``).

Request: ``input_prefix`` (before the cursor), ``input_suffix`` (after it), ``input_extra``
(``[{"filename", "text"}]``: other files as context), ``prompt`` (text already typed after the
cursor's middle token), and ``/completion``'s sampling options calserve has (``n_predict``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``, ``repeat_penalty``,
``presence_penalty``, ``frequency_penalty``, ``ignore_eos``, ``stream``); the rest of
llama-server's options (``cache_prompt``, ``samplers``, ``t_max_*_ms``, ``n_indent``, ...) are
accepted and have no effect. The prompt is llama-server's repo-level pattern when the model has
repository and file-separator tokens, else the extra context is prefixed as text::

    [BOS] FIM_REP "myproject\\n" (FIM_SEP filename "\\n" text)* FIM_SEP "filename\\n"
          FIM_PRE prefix FIM_SUF suffix FIM_MID prompt

When it does not fit the context with ``n_predict`` tokens after it, the extra context goes
first, then the suffix beyond a quarter of the room, then the prefix from its start
(``truncated: true``), as llama-server keeps the text nearest the cursor.

Answer (``/completion``'s shape): ``content``, ``stop``, ``stop_type`` (``eos`` / ``limit``),
``tokens_predicted``, ``tokens_evaluated``, ``truncated``, ``model``, ``timings``; streamed, a
``data: {"content", "stop": false}`` event per batch of text and a last one with ``stop: true``
and the rest (no ``[DONE]``, as llama-server).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import msgspec

from calserve import errors as E
from calserve.api.schemas import (MAX_STOP_STRINGS, CompletionBody, MinP, Penalty,
                                  RepetitionPenalty, Seed, Temperature, TopP)
from calserve.api.tokenizing import encode_text, max_text_chars
from calserve.engine.types import FinishEvent, FinishReason, RequestTimings, Usage
from calserve.models.fim import FimTokens

__all__ = ["InfillBody", "InfillInfo", "infill_request", "infill_json", "infill_summary"]

MAX_EXTRA_CHUNKS = 256
_CUT_FACTOR = 4  # a text up to this many contexts' worth is tokenized, then cut to fit
Filename = Annotated[str, msgspec.Meta(max_length=1024)]


class InfillChunk(msgspec.Struct, kw_only=True):
    filename: Filename = "tmp"
    text: str = ""


class InfillBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[InfillChunk], msgspec.Meta(max_length=MAX_EXTRA_CHUNKS)] | None = None
    prompt: str = ""
    n_predict: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1: to the end of the context
    temperature: Temperature | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    seed: Seed | None = None  # llama.cpp's -1 (random) is any negative seed here: a seed too
    stop: Annotated[list[str], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None = None
    repeat_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None


@dataclasses.dataclass(frozen=True)
class InfillInfo:
    """What the answer reports beyond the completion: whether the context was cut to fit."""

    truncated: bool


def _fit(extra: list[int], prefix: list[int], suffix: list[int], room: int
         ) -> tuple[list[int], list[int], list[int], bool]:
    """Cut the extra context, then the suffix beyond a quarter of ``room``, then the prefix from
    its start, until the three fit in ``room`` tokens."""
    total = len(extra) + len(prefix) + len(suffix)
    if total <= room:
        return extra, prefix, suffix, False
    room = max(0, room)
    suffix = suffix[:max(room // 4, room - len(prefix))]
    prefix = prefix[max(0, len(prefix) - (room - len(suffix))):]
    keep = max(0, room - len(prefix) - len(suffix))
    extra = extra[len(extra) - keep:] if keep else []
    return extra, prefix, suffix, True


def infill_request(tok: Any, fim: FimTokens | None, alias: str, max_seq: int, body: InfillBody
                   ) -> tuple[CompletionBody, InfillInfo]:
    """The ``/v1/completions`` body (a token prompt) an ``/infill`` body means, or a 400."""
    if fim is None:
        raise E.UnsupportedParameter(
            f"/infill needs a fill-in-the-middle model: {alias}'s vocabulary has no FIM"
            " prefix/suffix/middle tokens", param="input_suffix")
    chunks = body.input_extra or []
    cap = max_text_chars(tok, max_seq)  # what the context could hold, in characters
    for name, n_chars in (("input_prefix", len(body.input_prefix)),
                          ("input_suffix", len(body.input_suffix)), ("prompt", len(body.prompt)),
                          ("input_extra", sum(len(c.text) + len(c.filename) for c in chunks))):
        if cap is not None and n_chars > _CUT_FACTOR * cap:  # refused before any tokenizing
            raise E.RequestError(
                f"`{name}` has {n_chars} characters, more than {_CUT_FACTOR} x what this model's"
                f" {max_seq}-token context can hold ({cap}); it would be cut to fit anyway",
                param=name)

    def enc(text: str) -> list[int]:
        return list(encode_text(tok, text)) if text else []

    extra: list[int] = []
    if fim.rep is not None:
        extra += [fim.rep, *enc("myproject\n")]
    for c in chunks:
        extra += ([fim.sep, *enc(c.filename + "\n")] if fim.sep is not None
                  else enc("\n\n--- snippet ---\n\n"))
        extra += enc(c.text)
    if fim.sep is not None:
        extra += [fim.sep, *enc("filename\n")]
    prefix, suffix, typed = enc(body.input_prefix), enc(body.input_suffix), enc(body.prompt)
    with_bos = getattr(tok, "with_bos", None)  # BOS first when the model expects it
    bos: list[int] = list(with_bos([])) if with_bos is not None else []
    fixed = 3 + len(typed) + len(bos)
    n = body.n_predict if body.n_predict is not None and body.n_predict >= 0 else None
    want = n if n is not None else min(256, max_seq // 4)  # the room the answer is given
    extra, prefix, suffix, cut = _fit(extra, prefix, suffix, max_seq - fixed - max(1, want))
    ids = [*bos, *extra, *fim.prompt(prefix, suffix), *typed]
    room = max_seq - len(ids)
    if room < 1:
        raise E.RequestError(f"This model's maximum context length is {max_seq} tokens; the"
                             f" infill prompt has {len(ids)} tokens (context length exceeded)",
                             param="prompt")
    max_tokens = room if n is None or n > room else max(1, n)
    seed = body.seed if body.seed is None or body.seed >= 0 else None
    comp = CompletionBody(
        model=body.model, prompt=ids, max_tokens=max_tokens, temperature=body.temperature,
        top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, seed=seed, stop=body.stop,
        repetition_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, ignore_eos=body.ignore_eos, stream=body.stream,
        stop_token_ids=None if body.ignore_eos else list(fim.ends) or None)
    return comp, InfillInfo(cut)


def _stop_type(reason: FinishReason) -> str:
    return "eos" if reason is FinishReason.STOP else "limit"


def _timings(t: RequestTimings | None, usage: Usage) -> dict[str, float]:
    if t is None or t.ttft_s is None:
        return {}
    prompt_ms = max(0.0, (t.ttft_s - t.queue_s) * 1000.0)
    predicted_ms = max(0.0, (t.e2e_s - t.ttft_s) * 1000.0)
    pn, gn = usage.prompt_tokens, usage.completion_tokens
    return {"prompt_n": pn, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / pn if pn else 0.0,
            "prompt_per_second": 1000.0 * pn / prompt_ms if prompt_ms else 0.0,
            "predicted_n": gn, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / gn if gn else 0.0,
            "predicted_per_second": 1000.0 * gn / predicted_ms if predicted_ms else 0.0}


def infill_summary(alias: str, info: InfillInfo, ev: FinishEvent) -> dict[str, Any]:
    """What llama-server's last answer (event) says beside ``content``."""
    return {"stop": True, "model": alias, "stop_type": _stop_type(ev.reason), "stopping_word": "",
            "tokens_predicted": ev.usage.completion_tokens,
            "tokens_evaluated": ev.usage.prompt_tokens, "tokens_cached": 0,
            "truncated": info.truncated, "timings": _timings(ev.timings, ev.usage)}


def infill_json(alias: str, info: InfillInfo, text: str, ev: FinishEvent) -> dict[str, Any]:
    """llama-server's answer to a non-streamed ``/infill``."""
    return {"content": text, **infill_summary(alias, info, ev)}
