"""The package tokenizer: a thin wrapper over HF ``tokenizers`` plus a fixed ChatML renderer.

Chat template: calserve does not run Jinja. A package's ``chat_template`` may be ``None`` or
``"chatml"`` (the only supported value, the documented default); any other string is treated as the
ChatML form too, and the package validator warns nothing — Qwen3 checkpoints use ChatML, and the
Jinja extras of real Qwen3 templates (tools, thinking blocks) are out of scope. The rendering is::

    <|im_start|>{role}\\n{content}<|im_end|>\\n      for every message, in order
    <|im_start|>assistant\\n                         when add_generation_prompt

``role`` must be one of system/user/assistant/tool and ``content`` a string (or a list of
``{"type": "text", "text": ...}`` parts, joined) — anything else is a RequestError naming the field.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from calserve.errors import RequestError, ValidationError

__all__ = ["Tokenizer", "CHATML", "render_chatml"]

CHATML = "chatml"
_ROLES = frozenset({"system", "user", "assistant", "tool"})


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
    ) -> None:
        self._tok = tok
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template or CHATML
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        # Special (added) tokens are skipped by decode(skip_special_tokens=True).
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in tok.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        pad_token_id: int | None = None,
    ) -> Tokenizer:
        p = Path(path)
        try:
            tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise ValidationError(f"{p.name}: not a valid HF tokenizers file: {e}") from None
        return cls(tok, eos_token_ids, chat_template, pad_token_id)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in ``text`` map to their ids (ChatML needs it)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        t = self._tok.id_to_token(token_id)
        return None if t is None else str(t)

    def token_to_id(self, token: str) -> int | None:
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return render_chatml(messages, add_generation_prompt)
