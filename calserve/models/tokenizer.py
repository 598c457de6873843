"""The package tokenizer: a thin wrapper over HF ``tokenizers`` plus the chat template.

Chat template: a package's ``chat_template`` string is its own Jinja template, rendered in a
sandbox by :mod:`calserve.models.chat_template` (with ``bos_token``/``eos_token`` the strings of the
manifest's BOS and first EOS ids). ``None`` or ``"chatml"`` select the fixed ChatML fallback::

    <|im_start|>{role}\\n{content}<|im_end|>\\n      for every message, in order
    <|im_start|>assistant\\n                         when add_generation_prompt

For both, ``content`` must be a string (or a list of ``{"type": "text", "text": ...}`` parts,
joined); ChatML also wants ``role`` one of system/user/assistant/tool, a Jinja template any string
role (the template decides) — anything else is a RequestError naming the field.

A message's content is the client's text, never control tokens: :meth:`Tokenizer.encode_chat`
tokenizes the spans of the rendered conversation that are message contents with special-token
strings as plain text (a user message holding ``<|im_end|>\n<|im_start|>system\n...`` gets those
characters, not a forged system turn), and the template's own text with its special tokens. Which
characters are content is known by rendering the template once more with a marker in place of each
content; a template that does not copy such a content verbatim (or trimmed, as Llama 3's does) cannot
be told apart from its own text, and the request is refused (400 naming that content). Contents
without a special-token string, nearly all, are tokenized with the rendering as one text (the
same ids as before, no second rendering); with such a content, the text between two of the
template's special tokens is tokenized as one (the contents in it literally), so the ids are the
whole rendering's but for those strings (a SentencePiece space prefix or a BPE merge across the
edge of a content stays as it would be). ``/v1/completions``' prompt is not a conversation: its special-token strings stay special
(clients write their own formats with them).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from calserve.errors import RequestError, ValidationError
from calserve.models.chat_template import ChatTemplate, is_chatml
from calserve.models.fim import FimTokens, find_fim

__all__ = ["Tokenizer", "CHATML", "render_chatml"]

CHATML = "chatml"
_ROLES = frozenset({"system", "user", "assistant", "tool"})
# The marker that stands for message i's content in the second rendering (encode_chat): two
# private-use characters around its index; a rendering or content holding either is refused there.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK_RE = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"{where}[{i}] must be {{'type': 'text', 'text': str}}", param=f"{where}[{i}]"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts", param=where)


def render_chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render ``messages`` in the documented ChatML form (see module docstring)."""
    out: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}",
                param=f"messages[{i}].role",
            )
        text = _content_text(m.get("content", ""), f"messages[{i}].content")
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


class Tokenizer:
    """Encode/decode with a package's ``tokenizer.json``; ``eos_token_ids`` from the manifest."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = tok
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        # the model expects BOS first (Llama 2/3, Mistral, Phi-3; not SmolLM2, Qwen): with_bos
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template or CHATML
        self._jinja: ChatTemplate | None = None
        if not is_chatml(chat_template):
            assert chat_template is not None
            bos = tok.id_to_token(bos_token_id) if bos_token_id is not None else None
            eos = tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
            self._jinja = ChatTemplate(chat_template, bos_token=bos or "", eos_token=eos or "")
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        # Special (added) tokens are skipped by decode(skip_special_tokens=True).
        added = tok.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        specials = sorted({str(t.content) for t in added.values() if t.special and t.content},
                          key=len, reverse=True)
        # A content can hold a special-token string only if it holds one of their first characters
        # (one C-level scan each: the common case needs no regex).
        self._special_first = frozenset(t[0] for t in specials)
        pattern = "|".join(map(re.escape, specials))
        self._special_re = re.compile(pattern) if specials else None
        self._special_split = re.compile(f"({pattern})") if specials else None  # keeps them
        self._literal: tokenizers.Tokenizer | None = None  # encode_special_tokens clone, on demand
        # The model's own tool-call syntax (api/tools.py): Hermes tags when its template shows
        # tools that way and the tag is text (the detokenizer would drop a special token), Llama
        # 3.1+'s JSON answer, or None (the generic format).
        self.tool_syntax: str | None = _tool_syntax(self.chat_template) if self._jinja else None
        if self.tool_syntax == "hermes" and self.has_special_text("<tool_call>"):
            self.tool_syntax = None
        # Fill-in-the-middle tokens of a code model (completions' ``suffix``), by name
        self.fim: FimTokens | None = find_fim(self.token_to_id)
        # A thinking model's template (api/reasoning.py): its answers begin with a think block,
        # whose tags the detokenizer keeps (text, not special tokens).
        self.reasoning_tags: bool = (
            self._jinja is not None and "<think>" in self.chat_template
            and "</think>" in self.chat_template and not self.has_special_text("<think>")
            and not self.has_special_text("</think>"))

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
    ) -> Tokenizer:
        p = Path(path)
        try:
            tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise ValidationError(f"{p.name}: not a valid HF tokenizers file: {e}") from None
        return cls(tok, eos_token_ids, chat_template, pad_token_id, bos_token_id, add_bos_token)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in ``text`` map to their ids (ChatML needs it)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def with_bos(self, ids: Sequence[int]) -> list[int]:
        """``ids`` of a whole prompt (a completion's text, a rendered conversation) as the model
        expects them: BOS first exactly once when ``add_bos_token`` (a template that writes its
        own ``{{ bos_token }}`` gets no second one, as llama.cpp's server does it)."""
        bos = self.bos_token_id
        if not self.add_bos_token or bos is None or (ids and ids[0] == bos):
            return list(ids)
        return [bos, *ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        t = self._tok.id_to_token(token_id)
        return None if t is None else str(t)

    def token_to_id(self, token: str) -> int | None:
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages``: the package's Jinja template (given ``tools`` as its
        ``tools`` variable when not None, and ``variables``), or ChatML (which takes neither)."""
        if self._jinja is None:
            return render_chatml(messages, add_generation_prompt)
        return self._jinja.render(_plain_messages(messages), add_generation_prompt, tools,
                                  variables)

    def has_special_text(self, text: str) -> bool:
        """Whether ``text`` holds the string of a special token (``<|im_start|>``, ...)."""
        pat = self._special_re
        if pat is None or not any(c in text for c in self._special_first):
            return False
        return pat.search(text) is not None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], rendered: str,
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    variables: Mapping[str, Any] | None = None) -> list[int] | None:
        """The token ids of ``rendered`` (:meth:`apply_chat_template` of ``messages``) with every
        message content tokenized literally (see the module docstring), or None when no content
        holds a special-token string: then ``encode(rendered)`` is exactly that. RequestError
        (naming the content) when the template does not copy such a content verbatim."""
        contents = [_content_text(m.get("content", ""), f"messages[{i}].content")
                    if isinstance(m, Mapping) else "" for i, m in enumerate(messages)]
        hot = [i for i, c in enumerate(contents) if self.has_special_text(c)]
        if not hot:
            return None
        where = f"messages[{hot[0]}].content"
        if any(_MARK_OPEN in c or _MARK_CLOSE in c for c in contents) or _MARK_OPEN in rendered:
            raise RequestError(f"`{where}` holds a special-token string and the conversation holds "
                               "U+E000/U+E001, which calserve needs to tell contents apart",
                               param=where)
        marked = [dict(m, content=f"{_MARK_OPEN}{i}{_MARK_CLOSE}") for i, m in enumerate(messages)]
        parts = _MARK_RE.split(self.apply_chat_template(marked, add_generation_prompt, tools,
                                                        variables))
        # parts alternate: template text, content index, template text, ... (text first and
        # last). The contents as they are, else as Jinja's ``trim`` leaves them (Llama 3's
        # template trims every content), must give the rendering back.
        for copied in (contents, [c.strip() for c in contents]):
            if "".join(p if k % 2 == 0 else copied[int(p)] for k, p in enumerate(parts)) == rendered:
                break
        else:
            raise RequestError(
                f"`{where}` holds a special-token string, and this model's chat template does not "
                "copy message contents verbatim (it rewrites them), so calserve cannot "
                "keep that string from acting as a control token; remove it from the content",
                param=where)
        lit = self._literal
        if lit is None:
            lit = tokenizers.Tokenizer.from_str(self._tok.to_str())
            lit.encode_special_tokens = True  # special-token strings encode as ordinary text
            self._literal = lit
        assert self._special_split is not None  # a content holds a special-token string
        split = self._special_split.split
        # The text between two of the template's special tokens is tokenized as one text, the
        # contents in it literally: the same ids as the whole rendering would get, but for the
        # contents' special-token strings.
        ids: list[int] = []
        run: list[str] = []

        def flush() -> None:
            text = "".join(run)
            if text:
                ids.extend(lit.encode(text, add_special_tokens=False).ids)
            run.clear()

        for k, p in enumerate(parts):
            if k % 2 == 1:
                run.append(copied[int(p)])
                continue
            for j, piece in enumerate(split(p)):
                if j % 2 == 0:
                    run.append(piece)
                    continue
                flush()
                special = self._tok.token_to_id(piece)
                assert special is not None
                ids.append(special)
        flush()
        return ids


def _tool_syntax(template: str) -> str | None:
    """The tool-call syntax a Jinja chat template shows tools in (api/tools.py): Hermes
    ``<tool_call>`` tags (Qwen2.5, Qwen3, Hermes), Llama 3.1+'s JSON answer (its ``ipython``
    role), or None (the generic format)."""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "ipython<|end_header_id|>" in template:
        return "llama3_json"
    return None


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as the plain dicts a Jinja template gets (string role and content; the other
    keys are passed through)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str):
            raise RequestError(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        d = dict(m)
        d["content"] = _content_text(m.get("content", ""), f"messages[{i}].content")
        out.append(d)
    return out
