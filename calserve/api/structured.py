"""What constrains an answer besides tools: OpenAI's ``response_format``, and the structured-output
fields vLLM's and llama.cpp's clients send.

- OpenAI: ``response_format`` ``json_object`` / ``json_schema`` (``engine/grammar.py``).
- vLLM (>= 0.10.2): ``structured_outputs`` ``{"json": schema}``, ``{"regex": ...}``,
  ``{"choice": [...]}``, ``{"grammar": ...}`` or ``{"json_object": true}``; and the older
  top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (``guided_decoding_backend`` and ``guided_whitespace_pattern`` are accepted and ignored: there is
  one backend, and JSON is written without free whitespace).
- llama.cpp's server: ``json_schema`` (a schema) and ``grammar`` (GBNF).

A grammar is Lark (llguidance's dialect: ``start: ...``) or GBNF (``root ::= ...``), told apart
as llguidance tells them; a regex must match the whole answer; a choice answers one of the strings
exactly. All are compiled by llguidance for the model's tokenizer under the same limits as a JSON
schema (a compile or a mask step cannot run away), and enforced in full: the answer always matches.
At most one may be set (a 400 names the second); none with ``tools``, ``min_tokens`` or
``ignore_eos`` (they would sample past the end of the answer). Errors name the field as sent
(``structured_outputs.regex``, ``guided_choice``, ``grammar``, ...).
"""

from __future__ import annotations

import json
from typing import Any, Final

from calserve import errors as E
from calserve.api.schemas import SamplingFields
from calserve.engine.grammar import (
    Grammar, compile_grammar_text, compile_json_schema, compile_regex, compile_response_format,
)

__all__ = ["constraint_of", "answer_grammar", "MAX_CHOICES", "MAX_CHOICE_CHARS"]

MAX_CHOICES: Final = 256  # strings of one choice
MAX_CHOICE_CHARS: Final = 1024  # characters of one of them
# vLLM's structured_outputs keys (the constraint) and those accepted without effect
_SO_KINDS: Final = ("json", "regex", "choice", "grammar", "json_object")
_SO_IGNORED: Final = frozenset(("disable_fallback", "disable_any_whitespace",
                                "disable_additional_properties", "whitespace_pattern"))


def constraint_of(body: SamplingFields) -> tuple[str, str, Any] | None:
    """``(param, kind, value)`` of the one constraint ``body`` sets, ``kind`` one of json,
    json_object, regex, choice, grammar, response_format; None: none (``response_format``
    ``text`` is none). Two set: a 400 naming the second."""
    found: list[tuple[str, str, Any]] = []
    rf = body.response_format
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        found.append(("response_format", "response_format", rf))
    so = body.structured_outputs
    if so is not None:
        for key, value in so.items():
            if key in _SO_IGNORED or value is None or (key == "json_object" and value is False):
                continue
            if key not in _SO_KINDS:
                raise E.UnsupportedParameter(
                    f"`structured_outputs.{key}` is not supported (served: {', '.join(_SO_KINDS)})",
                    param=f"structured_outputs.{key}")
            found.append((f"structured_outputs.{key}", key, value))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                       ("json_schema", "json"), ("grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append((name, kind, value))
    if len(found) > 1:
        raise E.RequestError(
            f"`{found[1][0]}` and `{found[0][0]}` both constrain the answer: send one",
            param=found[1][0])
    return found[0] if found else None


def _choice_lark(param: str, value: Any) -> str:
    if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
        raise E.RequestError(f"`{param}` must be a list of 1 to {MAX_CHOICES} strings", param=param)
    for i, c in enumerate(value):
        if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
            raise E.RequestError(f"`{param}[{i}]` must be a string of 1 to {MAX_CHOICE_CHARS}"
                                 " characters", param=f"{param}[{i}]")
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)


def _compile(param: str, kind: str, value: Any, tok: Any, vocab: int) -> Grammar:
    if kind == "response_format":
        got = compile_response_format(value, tok, vocab)
        assert got is not None  # ``text`` is no constraint (constraint_of)
        return got
    if kind == "json_object":
        if value is not True:
            raise E.RequestError(f"`{param}` must be true or false", param=param)
        return compile_json_schema({"type": "object"}, tok, vocab, "json_object", param)
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) and value.lstrip()[:1] == "{" else value
        if not isinstance(schema, (dict, bool)):
            raise E.RequestError(f"`{param}` must be a JSON Schema (an object)", param=param)
        return compile_json_schema(schema, tok, vocab, "json_schema", param)
    if kind == "choice":
        return compile_grammar_text(_choice_lark(param, value), tok, vocab, param)
    if not isinstance(value, str) or not value:
        raise E.RequestError(f"`{param}` must be a non-empty string", param=param)
    if kind == "regex":
        return compile_regex(value, tok, vocab, param)
    return compile_grammar_text(value, tok, vocab, param)


def answer_grammar(body: SamplingFields, tok: Any, vocab: int) -> Grammar | None:
    """The grammar of the answer ``body`` asks for (module docstring), or None."""
    got = constraint_of(body)
    if got is None:
        return None
    param, kind, value = got
    for name in ("min_tokens", "ignore_eos"):  # refused before anything is compiled
        if getattr(body, name):
            raise E.UnsupportedParameter(
                f"`{name}` is not supported with `{param}` (it would sample past the end of the"
                " answer)", param=name)
    try:
        return _compile(param, kind, value, tok, vocab)
    except json.JSONDecodeError as e:
        raise E.RequestError(f"`{param}` is not valid JSON: {e}", param=param) from None
