"""Structured outputs besides ``response_format`` (api/structured.py): which field constrains the
answer, the 400 for two, and the repetition bound on regexes and grammars (engine/grammar.py),
checked against the product computed from the expression's own tree (hypothesis). The answers
themselves: tests/e2e/test_structured_openai.py (a real server and tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve import errors as E
from calserve.api.schemas import ChatBody
from calserve.api.structured import constraint_of
from calserve.engine.grammar import MAX_REPETITION, compile_grammar_text, compile_regex, nested_repetition
from calserve.models.demo import demo_tokenizer_json
from calserve.models.tokenizer import Tokenizer


def body(**kw: Any) -> ChatBody:
    return msgspec.convert({"messages": [{"role": "user", "content": "x"}], **kw}, ChatBody)


def test_which_field_constrains_the_answer() -> None:
    assert constraint_of(body()) is None
    assert constraint_of(body(response_format={"type": "text"})) is None
    assert constraint_of(body(guided_regex="a+")) == ("guided_regex", "regex", "a+")
    assert constraint_of(body(structured_outputs={"choice": ["a"], "disable_fallback": True})) \
        == ("structured_outputs.choice", "choice", ["a"])
    assert constraint_of(body(structured_outputs={"json_object": False})) is None
    assert constraint_of(body(grammar="root ::= \"a\"")) == ("grammar", "grammar", 'root ::= "a"')
    assert constraint_of(body(json_schema={"type": "object"}))[:2] == ("json_schema", "json")
    assert constraint_of(body(guided_decoding_backend="xgrammar")) is None
    with pytest.raises(E.RequestError) as ei:
        constraint_of(body(response_format={"type": "json_object"}, guided_choice=["a"]))
    assert ei.value.param == "guided_choice"
    with pytest.raises(E.RequestError) as ei:
        constraint_of(body(structured_outputs={"regex": "a", "choice": ["a"]}))
    assert ei.value.param == "structured_outputs.choice"
    with pytest.raises(E.UnsupportedParameter) as ei:
        constraint_of(body(structured_outputs={"structural_tag": {}}))
    assert ei.value.param == "structured_outputs.structural_tag"


@pytest.mark.parametrize(("text", "grammar", "want"), [
    ("a{1000}{1000}", False, 10**6), ("x(a{1000}){1000}", False, 10**6), ("(ab){10}{10}", False, 100),
    ("(a{30}|b){30}", False, 900), ("[{]{5}", False, 5), ("a\\{5000}", False, 1),
    ("a{3,}", False, 3), ("a{,99999}", False, 99999), ("[a-z]{1,8}@(com|org)", False, 8),
    ('root ::= "(" num ("," num){0,3} ")"\nnum ::= [0-9]{1,3}', True, 3),
    ("start: /a{5000}/", True, 5000), ('root ::= "a"{5000}', True, 5000),
    ('start: ("a" ~ 3..40) ~ 50', True, 2000), ('start: "{99999}"', True, 1),
    ('start: "x" ["a"{5000}]', True, 5000), ("root ::= [0-9]{1,3} [a-z]{2}", True, 3),
    ("start: /[a-z]{40}/ ~ 30", True, 1200),
])
def test_nested_repetition(text: str, grammar: bool, want: int) -> None:
    assert nested_repetition(text, grammar) == want


@dataclass
class Node:
    """A regex tree: a literal atom, a group of alternatives/sequence, a counted repetition."""

    kind: str  # "atom" | "seq" | "alt" | "rep"
    kids: list[Node]
    count: tuple[int, int | None] = (1, None)
    text: str = "a"

    def regex(self) -> str:
        if self.kind == "atom":
            return self.text
        if self.kind == "seq":
            return "(" + "".join(k.regex() for k in self.kids) + ")"
        if self.kind == "alt":
            return "(" + "|".join(k.regex() for k in self.kids) + ")"
        lo, hi = self.count
        q = f"{{{lo}}}" if hi is None else f"{{{lo},{hi}}}"
        return self.kids[0].regex() + q

    def product(self) -> int:
        """How many times this node's innermost atoms may repeat at most (a group counts as at
        least one: a ``{0}`` inside it repeats nothing outside)."""
        if self.kind == "atom":
            return 1
        if self.kind == "rep":
            lo, hi = self.count
            return max(lo, hi or 0) * self.kids[0].product()
        return max(1, *(k.product() for k in self.kids))

    def bound(self) -> int:
        """The largest product of any subtree (what the bound means: ``a{0,2}{0}`` has 2)."""
        return max([self.product(), *(k.bound() for k in self.kids)])


ATOMS = st.sampled_from(["a", "[a-z]", "\\(", "[{}]", "\\d", "[]x]"])
def _groups(kids: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
    seq = st.builds(lambda ks: Node("seq", ks), st.lists(kids, min_size=1, max_size=3))
    alt = st.builds(lambda ks: Node("alt", ks), st.lists(kids, min_size=2, max_size=3))
    rep = st.builds(lambda k, lo, hi: Node("rep", [k], (lo, hi)), kids, st.integers(0, 40),
                    st.one_of(st.none(), st.integers(0, 40)))
    return st.one_of(seq, alt, rep)


nodes = st.recursive(st.builds(lambda t: Node("atom", [], text=t), ATOMS), _groups, max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(nodes)
def test_the_bound_is_the_tree_s_product(node: Node) -> None:
    assert nested_repetition(node.regex()) == max(1, node.bound())


def test_past_the_bound_is_a_400_before_compiling() -> None:
    tok = Tokenizer(tokenizers.Tokenizer.from_str(demo_tokenizer_json()), (0,))
    for bad in ("a{1000}{1000}", f"(ab){{{MAX_REPETITION + 1}}}"):
        with pytest.raises(E.RequestError, match="repeats too much") as ei:
            compile_regex(bad, tok, tok.vocab_size, "guided_regex")
        assert ei.value.param == "guided_regex"
    with pytest.raises(E.RequestError, match="repeats too much"):
        compile_grammar_text('root ::= ("a"{100}){100}', tok, tok.vocab_size, "grammar")
    assert compile_regex(f"a{{{MAX_REPETITION}}}", tok, tok.vocab_size, "guided_regex").kind == "regex"
    with pytest.raises(E.RequestError, match="not a valid grammar|invalid grammar") as ei:
        compile_grammar_text("root ::= ((", tok, tok.vocab_size, "grammar")
    assert ei.value.param == "grammar"
