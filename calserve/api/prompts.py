"""A completion's prompts as token ids (``calserve/api/convert.py`` prepares the request):
OpenAI's four ``prompt`` forms (a string, token ids, a list of either), fill-in-the-middle
(``suffix``), vLLM's ``truncate_prompt_tokens``; each refusal a 400 naming the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from calserve import errors as E
from calserve.api.protocol import TokenizerLike
from calserve.api.schemas import SamplingFields
from calserve.api.tokenizing import check_text_fits, encode_text
from calserve.engine.types import ModelInfo
from calserve.models.fim import FimTokens

__all__ = ["vocab_size", "check_token_ids", "context_full", "batched", "prompt_list", "fim_of",
           "truncation", "prompt_ids"]


def vocab_size(tok: TokenizerLike, info: ModelInfo) -> int | None:
    v = info.extra.get("vocab_size", getattr(tok, "vocab_size", None))
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def check_token_ids(ids: Sequence[Any], vocab: int | None, param: str) -> tuple[int, ...]:
    out = []
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise E.RequestError(f"`{param}[{i}]` must be a token id (int)", param=f"{param}[{i}]")
        if t < 0 or (vocab is not None and t >= vocab):
            limit = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise E.RequestError(
                f"`{param}[{i}]` = {t} is not a token id in {limit}", param=f"{param}[{i}]"
            )
        out.append(t)
    return tuple(out)


def context_full(max_seq: int, prompt_len: int, param: str) -> E.RequestError:
    return E.RequestError(
        f"This model's maximum context length is {max_seq} tokens; the prompt has {prompt_len}"
        " tokens, leaving no room for a completion (context length exceeded)", param=param)


def batched(prompt: str | list[Any]) -> bool:
    """A list of prompts (strings or token-id lists), not one prompt."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def prompt_list(prompt: str | list[Any], max_prompts: int) -> Sequence[str | list[Any]]:
    """``prompt`` as the list of its prompts: a string or a list of token ids is one prompt; a list
    of strings, or of token-id lists, is one prompt each (OpenAI's four forms; not mixed), at most
    ``server.max_prompts`` of them."""
    if not batched(prompt):
        return [prompt]
    assert isinstance(prompt, list)
    if len(prompt) > max_prompts:
        raise E.RequestError(
            f"`prompt` holds {len(prompt)} prompts; at most {max_prompts} are allowed in one"
            " request (server.max_prompts)", param="prompt")
    kind = str if isinstance(prompt[0], str) else list
    for i, p in enumerate(prompt):
        if not isinstance(p, kind):
            raise E.RequestError(
                f"`prompt[{i}]` must be a {'string' if kind is str else 'list of token ids'} like"
                " `prompt[0]`: a list of prompts holds strings or token-id lists, not both",
                param=f"prompt[{i}]")
    return prompt


def fim_of(tok: TokenizerLike, info: ModelInfo, suffix: str) -> tuple[FimTokens, tuple[int, ...]]:
    """The model's fill-in-the-middle tokens and the suffix's ids, or a 400 naming ``suffix``."""
    fim: FimTokens | None = getattr(tok, "fim", None)
    if fim is None:
        raise E.UnsupportedParameter(
            f"`suffix` needs a fill-in-the-middle model: {info.alias}'s vocabulary has no FIM"
            " prefix/suffix/middle tokens", param="suffix")
    check_text_fits(tok, info.max_seq, len(suffix), "suffix", "the suffix")
    return fim, encode_text(tok, suffix)


def truncation(body: SamplingFields, info: ModelInfo) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: how many of the prompt's last tokens are served (-1:
    the model's context, as vLLM; a prompt that still leaves no room for the answer is the
    usual 400), or None."""
    k = body.truncate_prompt_tokens
    if k is None:
        return None
    if k == 0 or k > info.max_seq:
        raise E.RequestError(
            f"`truncate_prompt_tokens` must be -1 (the model's context) or from 1 to the model's"
            f" context ({info.max_seq} tokens), not {k}", param="truncate_prompt_tokens")
    return info.max_seq if k == -1 else k


def prompt_ids(tok: TokenizerLike, info: ModelInfo, prompt: str | list[Any], param: str,
                echo: bool | None, fim: tuple[FimTokens, tuple[int, ...]] | None = None,
                keep: int | None = None) -> tuple[tuple[int, ...], str]:
    """One prompt's token ids and text (the text only when echoed), or a 400 naming ``param``.
    ``fim``: the prompt is the prefix of a fill-in-the-middle prompt with that suffix (may be
    empty: the cursor at the start of the file). ``keep``: only the last ``keep`` tokens are
    the prompt (vLLM's ``truncate_prompt_tokens``; the echoed text is theirs)."""
    if fim is not None and isinstance(prompt, str):
        check_text_fits(tok, info.max_seq, len(prompt), param)
        fim_ids = fim[0].prompt(encode_text(tok, prompt) if prompt else (), fim[1])
        with_bos = getattr(tok, "with_bos", None)  # BOS first when the model expects it
        return tuple(with_bos(fim_ids) if with_bos is not None else fim_ids), ""
    if isinstance(prompt, str):
        if prompt == "":
            raise E.RequestError(f"`{param}` must not be empty", param=param)
        if keep is None:  # (truncated: any length is tokenized, the body's size bounds it)
            check_text_fits(tok, info.max_seq, len(prompt), param)
        ids = encode_text(tok, prompt, prompt=True)
        text = prompt
        if keep is not None and len(ids) > keep:
            ids = tuple(ids[-keep:])
            text = tok.decode(ids) if echo else ""
    else:
        if not prompt:
            raise E.RequestError(f"`{param}` must not be empty", param=param)
        if keep is not None:
            prompt = prompt[-keep:]
        if len(prompt) >= info.max_seq:  # before checking each id: the count alone decides
            raise context_full(info.max_seq, len(prompt), param)
        ids = check_token_ids(prompt, vocab_size(tok, info), param)
        text = tok.decode(ids) if echo else ""
        if fim is not None:  # token ids: the prefix's, as given
            ids = tuple(fim[0].prompt(ids, fim[1]))
    if not ids:
        raise E.RequestError(f"`{param}` encodes to zero tokens", param=param)
    return ids, text
