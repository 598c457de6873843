"""The package's own Jinja chat template (sandboxed, bounded) and the ChatML fallback.

The fixtures under ``chat_templates/`` are real templates as models ship them: SmolLM2-135M-Instruct's
(from its GGUF ``tokenizer.chat_template``), Qwen2.5-Instruct's (tools, ``tojson``, ``namespace``-free
ChatML with a default system prompt) and Meta-Llama-3-Instruct's (``bos_token``, ``trim``). The
expected texts are written out by hand from the templates' documented shapes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from calserve.errors import RequestError, ValidationError
from calserve.models.chat_template import ChatTemplate
from calserve.models.demo_model import demo_tokenizer_json
from calserve.models.tokenizer import Tokenizer

import tokenizers

FIXTURES = Path(__file__).parent / "chat_templates"


def fixture(name: str) -> str:
    return (FIXTURES / f"{name}.jinja").read_text()


def demo_tok(template: str | None) -> Tokenizer:
    hf = tokenizers.Tokenizer.from_str(demo_tokenizer_json())
    im_end = hf.token_to_id("<|im_end|>")
    bos = hf.token_to_id("<|im_start|>")
    return Tokenizer(hf, (im_end,), template, None, bos)


CONV = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_template_adds_its_default_system_prompt() -> None:
    tok = demo_tok(fixture("smollm2"))
    s = tok.apply_chat_template(CONV)
    assert s == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                 "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                 "<|im_end|>\n<|im_start|>assistant\n")
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *CONV],
                                  add_generation_prompt=False)
    assert own == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                   "What is the capital of France?<|im_end|>\n")
    # the special-token strings become single ids
    ids = tok.encode(s)
    assert ids[0] == tok.token_to_id("<|im_start|>")


def test_qwen25_template_renders_conversation_and_default_system() -> None:
    tok = demo_tok(fixture("qwen2_5"))
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
    s = tok.apply_chat_template(msgs)
    assert s == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                 "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                 "Hello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_llama3_template_uses_bos_token_and_trim() -> None:
    t = ChatTemplate(fixture("llama3"), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    s = t.render([{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "Hi"}])
    assert s == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not t.render(CONV, add_generation_prompt=False).endswith("\n\n")


def test_demo_tokenizer_bos_eos_strings_reach_the_template() -> None:
    tok = demo_tok("{{ bos_token }}|{{ eos_token }}")
    assert tok.apply_chat_template(CONV) == "<|im_start|>|<|im_end|>"


def test_hf_helpers_and_whitespace_control() -> None:
    t = ChatTemplate("{% for m in messages %}\n  {{ m | tojson }}\n{% endfor %}"
                     "{{ strftime_now('%Y') | length }}")
    out = t.render([{"role": "user", "content": "é ü 日本"}])
    # trim_blocks + lstrip_blocks: the block lines leave no whitespace; tojson keeps non-ASCII
    assert out == '  {"role": "user", "content": "é ü 日本"}\n4'
    t2 = ChatTemplate("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}")
    assert t2.render(CONV) == "012"


def test_chatml_fallback_for_none_and_chatml() -> None:
    for tmpl in (None, "chatml"):
        tok = demo_tok(tmpl)
        assert tok.apply_chat_template(CONV) == (
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("source", [
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
    "{{ messages[5].content }}",  # fails on these messages
    "{{ messages.append(1) }}",  # immutable sandbox
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # no escape from the sandbox
    "{{ 'x' * 10**9 }}",  # output bomb
    "{{ 7 ** 100000000 }}",  # arithmetic bomb (jinja folds no intercepted operator at compile)
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # loops
    "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",  # output past the bound
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",  # unbounded recursion
    "{{ range(10**9) | list }}",  # past the sandbox's range bound
    "{{ 1 / 0 }}",
    "{{ 'x'.center(10**8) }}",  # a method call's result past the bound
    "{{ 'ab' | wordwrap(3) * 10**7 }}",  # a filter's result repeated past the bound
])
def test_a_failing_or_runaway_template_is_a_request_error_naming_messages(source: str) -> None:
    tok = demo_tok(source)
    t0 = time.monotonic()
    with pytest.raises(RequestError) as e:
        tok.apply_chat_template(CONV)
    assert e.value.param == "messages"
    assert time.monotonic() - t0 < 3.0  # bounded (0.5 s of rendering, plus slack for a busy box)


def test_a_template_that_does_not_compile_is_refused_at_load() -> None:
    with pytest.raises(ValidationError, match="chat_template"):
        demo_tok("{% for m in messages %}")


def test_bad_message_fields_are_named() -> None:
    tok = demo_tok(fixture("smollm2"))
    with pytest.raises(RequestError) as e:
        tok.apply_chat_template([{"role": 3, "content": "x"}])  # type: ignore[dict-item]
    assert e.value.param == "messages[0].role"
    with pytest.raises(RequestError) as e:
        tok.apply_chat_template([{"role": "user", "content": 3}])  # type: ignore[dict-item]
    assert e.value.param == "messages[0].content"


def test_a_package_serves_its_own_template(pkg_copy: Path, model_root: Path, dev_trust: Any,
                                           edit_manifest: Any) -> None:
    """The manifest's ``chat_template`` reaches the package tokenizer (with the BOS/EOS strings of
    its special tokens); a template that does not compile refuses the package at load."""
    from calserve.models.package import open_package

    def use(tmpl: str) -> Any:
        def fn(m: dict[str, Any]) -> None:
            m["chat_template"] = tmpl
            m["special_tokens"]["bos_token_id"] = 1  # <|im_start|> in the demo vocabulary
        return fn

    edit_manifest(pkg_copy, use("{{ bos_token }}" + fixture("smollm2") + "{{ eos_token }}"))
    tok = open_package(pkg_copy, dev_trust, model_root).tokenizer()
    s = tok.apply_chat_template(CONV)
    assert s.startswith("<|im_start|><|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert s.endswith("<|im_start|>assistant\n<|im_end|>")
    edit_manifest(pkg_copy, use("{% if %}"))
    with pytest.raises(ValidationError, match="chat_template"):
        open_package(pkg_copy, dev_trust, model_root).tokenizer()
