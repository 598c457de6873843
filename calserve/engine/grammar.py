"""Constrained decoding for ``response_format`` (``json_object``, ``json_schema``) with llguidance.

- :func:`compile_response_format` (HTTP layer, at request preparation): the OpenAI
  ``response_format`` object -> a :class:`Grammar` (a JSON-schema grammar compiled for the model's
  tokenizer and checked by building its matcher once), or None for ``text``. A malformed object, a
  schema that is not valid JSON Schema, or one with a keyword llguidance cannot enforce exactly (it
  runs with ``lenient`` off, so an accepted schema is always enforced in full) is a
  :class:`~calserve.errors.RequestError` naming ``response_format``. ``strict`` is accepted either
  way: the output is always held to the whole schema.
- :class:`GrammarState` (engine, one per request, ``Seq.sampling_state``): a matcher that catches up
  with the request's generated tokens before every draw (:meth:`GrammarState.sync`), so after a
  re-prefill it simply continues; :meth:`GrammarState.rebuild` replays the tokens into a fresh
  matcher (used when it ever sees a shorter token list than it consumed).
- :func:`fill_masks`: the next-token bitmasks of every constrained lane of a batch in one
  llguidance call (its own worker threads), which the sampler applies (``engine/logits.py``).

EOS: the grammar's tokenizer is given the model's EOS ids, so a mask allows EOS exactly where the
grammar may end, and nothing but EOS once it is complete; ``min_tokens`` and ``ignore_eos`` (which
would make the engine sample past EOS) are refused with a ``response_format`` (``api/convert.py``).
Whitespace between JSON tokens is not free (``whitespace_flexible`` off unless the schema's own
``x-guidance`` says otherwise): a model must not be able to pad its answer forever.

Bounded work (a schema is attacker-chosen, and its compile and every per-token mask run on shared
paths): before compiling, :func:`check_schema_bounds` refuses a schema nested deeper than
:data:`MAX_SCHEMA_DEPTH`, with more than :data:`MAX_SCHEMA_NODES` values in all, an object with
more than :data:`MAX_SCHEMA_PROPERTIES` properties, a list (``enum``, ``required``, ...) of more
than :data:`MAX_SCHEMA_LIST_ITEMS` items, or ``anyOf``/``oneOf``/``allOf`` nested more than
:data:`MAX_SCHEMA_COMBINATOR_NESTING` deep (llguidance's compile time grows quadratically with an
object's optional properties and exponentially with nested alternatives: 1,000 optional properties
took 0.2 s, 10 nested ``anyOf`` 0.3 s, 5,000 properties 4.7 s). What passes is compiled under
:data:`LIMITS` (llguidance's own fuel: grammar size, lexer states and fuel, Earley items per mask
step), so neither the compile nor a mask step can run away; a schema over them is a 400 too.
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final, final

import llguidance
import llguidance.numpy as llg_np
from llguidance.gbnf_to_lark import any_to_lark
import numpy as np
import numpy.typing as npt

from calserve.errors import RequestError

__all__ = ["Grammar", "GrammarState", "compile_response_format", "compile_json_schema",
           "compile_lark", "compile_regex", "compile_grammar_text", "fill_masks", "grammar_tokenizer", "GRAMMAR_CACHE",
           "check_schema_bounds", "LIMITS", "MAX_SCHEMA_DEPTH", "MAX_SCHEMA_NODES",
           "MAX_SCHEMA_PROPERTIES", "MAX_SCHEMA_LIST_ITEMS", "MAX_SCHEMA_COMBINATOR_NESTING"]

_PARAM: Final = "response_format"
_JSON_DEFAULTS: Final[Any] = {"whitespace_flexible": False}

#: Bounds on a ``response_format`` schema (module docstring), checked before compiling.
MAX_SCHEMA_DEPTH: Final = 32  # nesting of objects/arrays in the schema document
MAX_SCHEMA_NODES: Final = 4096  # every object, array and scalar in it
MAX_SCHEMA_PROPERTIES: Final = 256  # keys of one ``properties`` (or any one object)
MAX_SCHEMA_LIST_ITEMS: Final = 1024  # items of one list (``enum``, ``required``, ``anyOf``, ...)
MAX_SCHEMA_COMBINATOR_NESTING: Final = 6  # anyOf/oneOf/allOf inside one another
_COMBINATORS: Final = frozenset(("anyOf", "oneOf", "allOf"))
#: llguidance's resource limits for compiling and for every mask step (defaults in brackets):
#: grammar symbols 50k [500k], lexer states 50k [250k], initial lexer fuel 1M (~20 ms) [1M], per
#: mask step lexer fuel 50k (~4 ms) [200k] and Earley items 20k (~1 ms) [50k], a production
#: row's alternatives 1,000 [2,000].
LIMITS: Final = llguidance.LLParserLimits(
    max_grammar_size=50_000, max_lexer_states=50_000, initial_lexer_fuel=1_000_000,
    step_lexer_fuel=50_000, step_max_items=20_000, max_items_in_row=1_000)

_BRACES: Final = re.compile(r"\{\s*(\d{0,9})\s*(?:,\s*(\d{0,9})\s*)?\}")
_LARK_TIMES: Final = re.compile(r"~\s*(\d{1,9})(?:\s*\.\.\s*(\d{1,9}))?")

_lock = threading.Lock()
# tokenizer object -> {vocab size: its LLTokenizer} (building one reads the whole vocabulary: once)
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[int, llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary())
_executor: llguidance.LLExecutor | None = None
#: Compiled grammars by tokenizer and schema text, the most recent :data:`GRAMMAR_CACHE` per
#: tokenizer: an agent sends the same tools (a client the same ``response_format``) request after
#: request, and a compile costs 1-20 ms of CPU (1 to 50 tools of four arguments, SmolLM2's
#: tokenizer); a :class:`Grammar` is never advanced (each request deep-copies its matcher).
GRAMMAR_CACHE: Final = 64
_COMPILED: weakref.WeakKeyDictionary[Any, dict[tuple[int, str, str], Grammar]] = (
    weakref.WeakKeyDictionary())  # package tokenizer -> {(vocab, kind, schema text): grammar}


def _bad(msg: str, param: str = _PARAM) -> RequestError:
    return RequestError(msg, param=param)


def grammar_tokenizer(tok: Any, vocab: int, param: str = _PARAM) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of the package tokenizer ``tok`` (``tok.backend`` is its HF
    ``tokenizers.Tokenizer``) for logits of width ``vocab``, EOS = the model's EOS ids; cached.
    Its 400s (no usable tokenizer) name ``param``."""
    with _lock:
        per = _TOKENIZERS.setdefault(tok, {})
        ll = per.get(vocab)
        if ll is None:
            backend = getattr(tok, "backend", None)
            if backend is None or not hasattr(backend, "to_str"):
                raise _bad("constrained decoding needs the model's tokenizer.json tokenizer", param)
            eos = [int(t) for t in tok.eos_token_ids]
            if not eos:
                raise _bad("constrained decoding needs the model's EOS token", param)
            try:
                ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=eos)
            except Exception as e:  # a tokenizer llguidance cannot read: no constrained decoding
                raise _bad(f"constrained decoding is not available for this model's tokenizer:"
                           f" {str(e)[:300]}", param) from None
            per[vocab] = ll
        return ll


def _executor_() -> llguidance.LLExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))
        return _executor


@final
class Grammar:
    """A compiled grammar for one tokenizer; :meth:`new_state` gives each request its matcher."""

    __slots__ = ("kind", "schema", "_template")

    def __init__(self, kind: str, schema: Any, template: llguidance.LLMatcher) -> None:
        self.kind = kind  # "json_object" | "json_schema" | "tools_hermes" | "tools_llama3_json"
        self.schema = schema  # the JSON schema enforced (tests validate against it)
        self._template = template  # never advanced: deep-copied per request

    def new_state(self) -> GrammarState:
        return GrammarState(self._template.deep_copy())

    def __repr__(self) -> str:
        return f"Grammar({self.kind})"


@final
class GrammarState:
    """One request's matcher and how many of its generated tokens it has consumed."""

    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0

    def sync(self, tokens: Sequence[int]) -> None:
        """Advance over the tokens generated since the last draw."""
        if len(tokens) < self.consumed:
            self.rebuild(tokens)
            return
        if len(tokens) > self.consumed:
            self.matcher.consume_tokens(list(tokens[self.consumed:]))  # False: error state
            self.consumed = len(tokens)

    def rebuild(self, tokens: Sequence[int]) -> None:
        """Start over and replay ``tokens`` (the matcher's state is a function of them)."""
        self.matcher.reset()
        self.consumed = 0
        self.sync(tokens)

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())


def fill_masks(states: Sequence[GrammarState], vocab: int) -> npt.NDArray[np.int32]:
    """[len(states), ceil(vocab / 32)] int32 bitmasks of the tokens each may take next (all zero
    for a matcher in its error state: that lane's draw then fails alone)."""
    out = np.zeros(llg_np.get_bitmask_shape(len(states), vocab), dtype=np.int32)
    live = [(g.matcher, i) for i, g in enumerate(states) if not g.matcher.is_error()]
    if live:
        llg_np.fill_next_token_bitmask_par(_executor_(), live, out)
    return out


def _schema_of(rf: Any) -> tuple[str, Any] | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _bad("`response_format` must be an object with a `type`")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, {"type": "object"}
    if kind != "json_schema":
        raise _bad("`response_format.type` must be one of text, json_object, json_schema")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("`response_format.json_schema` must be an object with a `schema`")
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise _bad("`response_format.json_schema.name` must be a string")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("`response_format.json_schema.strict` must be a boolean")
    schema = js.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise _bad("`response_format.json_schema.schema` must be a JSON Schema object")
    return kind, schema


def check_schema_bounds(schema: Any, param: str = _PARAM) -> None:
    """Raise the 400 (naming ``param``) of a schema past one of the bounds (module
    docstring). Iterative: the walk itself is bounded by :data:`MAX_SCHEMA_NODES`."""
    nodes = 0
    # (value, depth, combinators around it)
    todo: list[tuple[Any, int, int]] = [(schema, 1, 0)]
    while todo:
        value, depth, comb = todo.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _bad(f"`{param}` schema is too large: more than {MAX_SCHEMA_NODES}"
                       " values", param)
        if isinstance(value, dict):
            children: Any = value.items()
            if len(value) > MAX_SCHEMA_PROPERTIES:
                raise _bad(f"`{param}` schema has an object with {len(value)} keys"
                           f" (at most {MAX_SCHEMA_PROPERTIES})", param)
        elif isinstance(value, list):
            children = ((None, v) for v in value)
            if len(value) > MAX_SCHEMA_LIST_ITEMS:
                raise _bad(f"`{param}` schema has a list of {len(value)} items"
                           f" (at most {MAX_SCHEMA_LIST_ITEMS})", param)
        else:
            continue
        if depth >= MAX_SCHEMA_DEPTH:
            raise _bad(f"`{param}` schema is nested deeper than {MAX_SCHEMA_DEPTH}"
                       " levels", param)
        for key, child in children:
            c = comb + 1 if key in _COMBINATORS else comb
            if c > MAX_SCHEMA_COMBINATOR_NESTING:
                raise _bad(f"`{param}` schema nests anyOf/oneOf/allOf more than"
                           f" {MAX_SCHEMA_COMBINATOR_NESTING} deep", param)
            todo.append((child, depth + 1, c))


def compile_response_format(rf: Any, tok: Any, vocab: int) -> Grammar | None:
    """The grammar of an OpenAI ``response_format`` (None for text / absent); 400s name it."""
    got = _schema_of(rf)
    if got is None:
        return None
    kind, schema = got
    return compile_json_schema(schema, tok, vocab, kind)


def compile_json_schema(schema: Any, tok: Any, vocab: int, kind: str = "json_schema",
                        param: str = _PARAM) -> Grammar:
    """The grammar of a JSON schema for ``tok`` (bounded, validated, enforced in full: the module
    docstring); its 400s name ``param`` (``response_format``, or ``tools`` for tool calling)."""
    check_schema_bounds(schema, param)
    try:
        text = json.dumps(schema)
    except Exception as e:  # ValueError/TypeError for a value JSON cannot hold; never a 500
        raise _bad(f"`{param}` has an invalid schema: {str(e)[:500]}", param) from None
    return _compiled(tok, vocab, kind, text, schema, param, lambda: (
        llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_DEFAULTS)))


def compile_lark(lark: str, schema: Any, tok: Any, vocab: int, kind: str, param: str) -> Grammar:
    """The grammar of a Lark grammar in llguidance's dialect (tool calls in a model's own syntax,
    ``api/tools_hermes.py``, ``api/tools_llama.py``) for ``tok``, compiled and checked as
    :func:`compile_json_schema` compiles a schema; ``schema``: the JSON schema embedded in it (its bounds are checked first;
    kept on the grammar for tests). Its 400s name ``param``."""
    check_schema_bounds(schema, param)
    return _compiled(tok, vocab, kind, lark, schema, param,
                     lambda: llguidance.LLMatcher.grammar_from_lark(lark))


#: The largest product of counted repetitions nested in a regex or grammar text (``a{30}{30}`` is
#: 900): llguidance's lexer grows with it — a mask step of ``a{5000}`` took 1.5 ms, the first mask
#: of ``a{1000}{1000}`` 1.2 s (and the lane then failed) — before any limit of its own applies.
MAX_REPETITION: Final = 1000


def _count(text: str, i: int, lark: bool) -> tuple[int, int] | None:
    """The repetition count (its largest) of the quantifier at ``text[i]`` and where it ends."""
    m = (_LARK_TIMES if lark and text[i] == "~" else _BRACES).match(text, i)
    counts = [int(g) for g in m.groups() if g] if m is not None else []
    return (max(counts), m.end()) if m is not None and counts else None


def nested_repetition(text: str, grammar: bool = False) -> int:
    """The largest product of counted repetitions nested in ``text``: a regex, or (``grammar``) a
    Lark / GBNF grammar (``{m}``, ``{m,n}``, ``{m,}``, Lark's ``~ m`` and ``~ m..n``). Groups are
    parentheses (in a grammar also a Lark ``/regex/`` and ``[optional]``); character classes (of
    a regex), string literals and escapes are atoms. Repetitions across rule references are not
    multiplied."""
    levels = [[1, 1]]  # per open group: [largest product inside, product of the last atom]
    i, n = 0, len(text)
    in_regex = False
    while i < n:
        c = text[i]
        cur = levels[-1]
        if c == "\\":
            cur[1] = 1
            i += 2
            continue
        if c == "[" and (in_regex or not grammar):  # a character class
            j = i + 1 + (text.startswith("^", i + 1))
            j += text.startswith("]", j)
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            cur[1] = 1
            i = j + 1
            continue
        if grammar and not in_regex and c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            cur[1] = 1
            i = j + 1
            continue
        # groups: parentheses; in a grammar also a Lark /regex/ and a Lark [optional] (taken as
        # a group in GBNF too, where it is a character class: its braces count all the same)
        opens = c == "(" or (grammar and not in_regex and c in "/[")
        closes = c == ")" or (grammar and (c == "/" if in_regex else c == "]"))
        if opens or closes:
            if c == "/":
                in_regex = opens
            if opens:
                levels.append([1, 1])
            elif len(levels) > 1:
                inner = levels.pop()[0]
                levels[-1][1] = inner
                levels[-1][0] = max(levels[-1][0], inner)
            i += 1
            continue
        q = _count(text, i, grammar) if c in "{~" else None
        if q is not None:
            cur[1] = min(cur[1] * q[0], 10**12)
            cur[0] = max(cur[0], cur[1])
            i = q[1]
            continue
        if not c.isspace():
            cur[1] = 1
        i += 1
    while len(levels) > 1:  # unbalanced: what is open counts as closed
        inner = levels.pop()[0]
        levels[-1][0] = max(levels[-1][0], inner)
    return levels[0][0]


def _check_repetition(text: str, grammar: bool, param: str) -> None:
    if nested_repetition(text, grammar) > MAX_REPETITION:
        raise _bad(f"`{param}` repeats too much: counted repetitions nested to more than"
                   f" {MAX_REPETITION} in all", param)


def compile_regex(regex: str, tok: Any, vocab: int, param: str) -> Grammar:
    """The grammar of text that matches ``regex`` in full (vLLM's ``guided_regex``), compiled and
    checked under :data:`LIMITS` (a regex whose automaton is too big is a 400 naming ``param``)."""
    _check_repetition(regex, False, param)
    return _compiled(tok, vocab, "regex", regex, None, param,
                     lambda: llguidance.LLMatcher.grammar_from_regex(regex))


def compile_grammar_text(grammar: str, tok: Any, vocab: int, param: str) -> Grammar:
    """The grammar of a Lark (llguidance's dialect) or GBNF (llama.cpp's: ``root ::= ...``) text,
    told apart as llguidance tells them apart, compiled and checked under :data:`LIMITS`."""
    _check_repetition(grammar, True, param)
    try:
        lark = any_to_lark(grammar)
    except Exception as e:  # GbnfToLarkError and the parser's own errors: a 400, never a 500
        raise _bad(f"`{param}` is not a valid grammar: {str(e)[:500]}", param) from None
    return _compiled(tok, vocab, "grammar", lark, None, param,
                     lambda: llguidance.LLMatcher.grammar_from_lark(lark))


def _compiled(tok: Any, vocab: int, kind: str, text: str, schema: Any, param: str,
              build: Callable[[], str]) -> Grammar:
    """The :class:`Grammar` ``build()`` gives (llguidance's grammar text), validated under
    :data:`LIMITS` for ``tok``, from the cache when ``(vocab, kind, text)`` was compiled lately."""
    ll = grammar_tokenizer(tok, vocab, param)
    key = (vocab, kind, text)
    with _lock:
        cache = _COMPILED.setdefault(tok, {})
        hit = cache.pop(key, None)
        if hit is not None:
            cache[key] = hit  # the most recent last
            return hit
    what = "schema" if schema is not None or kind.startswith("json") else kind
    try:
        grammar = build()
    except Exception as e:  # ValueError/TypeError for a malformed schema; never a 500
        raise _bad(f"`{param}` has an invalid {what}: {str(e)[:500]}", param) from None
    is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll, limits=LIMITS)
    if is_err:
        raise _bad(f"`{param}` {what} cannot be enforced: {' '.join(msgs)[:500]}", param)
    m = llguidance.LLMatcher(ll, grammar, log_level=0, limits=LIMITS)
    if m.is_error():
        raise _bad(f"`{param}` {what} cannot be enforced: {m.get_error()[:500]}", param)
    out = Grammar(kind, schema, m)
    with _lock:
        cache = _COMPILED.setdefault(tok, {})
        cache[key] = out
        while len(cache) > GRAMMAR_CACHE:
            del cache[next(iter(cache))]
    return out
