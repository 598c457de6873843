"""Request bodies of the OpenAI-compatible routes, decoded with msgspec.

Decisions (documented in README.md, "HTTP API"):

- Unknown fields are ignored (as vLLM does): OpenAI clients send many optional fields (``store``,
  ``metadata``, ``service_tier``, ...). Fields we *know* and cannot honour without changing results are
  listed here and rejected with 400 naming the parameter (see ``calserve.api.convert``).
- ``prompt`` is one string, one list of token ids, or a list of prompts (strings or token-id lists,
  up to ``server.max_prompts``: ``convert.py``).
- ``null`` is accepted for every optional field and means "default".
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "StreamOptions",
    "SamplingFields",
    "CompletionBody",
    "ChatMessage",
    "ChatBody",
    "TokenizeBody",
    "DetokenizeBody",
    "param_from_msgspec",
]

# Every field is bounded here to what each layer below can represent and afford (issue 12): Python
# ints become numpy int64 / C int32 values, so no integer field admits more than INT32_MAX (token
# ids, counts, top_k) or the int64 range (seed); floats are finite by their range; strings and lists
# have a length cap. ``convert.py`` checks what depends on the model (vocabulary, context length).
INT32_MAX = 2**31 - 1
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids entries (checked per token as a set lookup)
MAX_STOP_CHARS = 256  # characters of one stop string (the matcher holds back this much text)
MAX_USER_CHARS = 1024  # the `user` label (logged)

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
# -1/0 = off; a k at or above the vocabulary is off too (convert.py)
TopK = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)]
PosInt = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
LogprobsK = Annotated[int, msgspec.Meta(ge=0, le=20)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# n / best_of: only 1 is served (convert.py says why); the bound keeps the message about that
Count = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
MAX_STOP_STRINGS = 16  # stop strings of a request (convert.py checks them; /infill's schema too)
MAX_LOGIT_BIAS = 1024  # logit_bias entries (OpenAI's own cap is lower)
RepetitionPenalty = Annotated[float, msgspec.Meta(ge=0.01, le=10.0)]  # below: logits overflow
StopTokenIds = Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)]
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # vLLM's allowed_token_ids (the largest vocabularies: 262,144)
AllowedTokenIds = Annotated[list[NonNegInt], msgspec.Meta(min_length=1,
                                                          max_length=MAX_ALLOWED_TOKEN_IDS)]
User = Annotated[str, msgspec.Meta(max_length=MAX_USER_CHARS)]
MAX_REGEX_CHARS = 4096  # a guided regex (its automaton is bounded again when compiled)
MAX_GRAMMAR_CHARS = 65536  # a Lark/GBNF grammar (likewise)
Regex = Annotated[str, msgspec.Meta(max_length=MAX_REGEX_CHARS)]
GrammarText = Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # vLLM extension; -1 and 0 mean off
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: StopTokenIds | None = None  # vLLM extension
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: User | None = None
    ignore_eos: bool | None = None  # vLLM / llama.cpp benchmark extension
    min_tokens: NonNegInt | None = None  # vLLM extension
    n: Count | None = None  # up to server.max_n (convert.py)
    # token id (a decimal string) -> bias in [-100, 100] (convert.py checks ids and values)
    logit_bias: Annotated[dict[str, Any], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM extension
    min_p: MinP | None = None  # vLLM extension
    # vLLM extensions: only these tokens may be drawn; the matched stop string kept in the text
    allowed_token_ids: AllowedTokenIds | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None  # vLLM: false keeps special tokens in the text
    response_format: Any = None  # text | json_object | json_schema (engine/grammar.py)
    # vLLM's and llama.cpp's structured outputs (api/structured.py: at most one constraint)
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Regex | None = None
    guided_choice: Annotated[list[Any], msgspec.Meta(max_length=256)] | None = None
    guided_grammar: GrammarText | None = None
    guided_decoding_backend: str | None = None  # accepted, ignored (one backend: llguidance)
    guided_whitespace_pattern: str | None = None  # accepted, ignored (no free whitespace)
    json_schema: Any = None  # llama.cpp
    grammar: GrammarText | None = None  # llama.cpp (GBNF; Lark too)
    # Chat only: tool calling (api/tools.py checks them); the legacy ``functions`` /
    # ``function_call`` are refused (convert.py)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Extension (vLLM): each prompt token's logprob with the k most likely tokens at its position
    # (JSON answers only: refused with ``stream``, as vLLM does)
    prompt_logprobs: LogprobsK | None = None
    # Extension (vLLM): only the prompt's last k tokens are served (-1: the model's context);
    # checked in convert.py (_truncation)
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=1 << 31)] | None = None
    # Known but not supported when they would change results (checked in convert.py):
    best_of: Count | None = None
    functions: Any = None
    function_call: Any = None


class CompletionBody(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: NonNegInt | None = None  # 0: only with echo + logprobs (convert.py)
    logprobs: LogprobsK | None = None
    echo: bool | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None


class ChatBody(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobsK | None = None
    # Extensions (vLLM): the template's generation prompt, and variables for the model's own
    # chat template (``{"enable_thinking": false}`` for Qwen3; api/chat_prompt.template_variables)
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Extension (llama.cpp): "auto" (the default) returns a thinking model's reasoning apart, as
    # ``reasoning_content``; "none" leaves it in ``content`` (api/reasoning.py)
    reasoning_format: Literal["auto", "none"] | None = None


class TokenizeBody(msgspec.Struct, kw_only=True):
    """vLLM shape (``prompt`` or ``messages``) and llama.cpp shape (``content``)."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # with ``messages``: as a chat request's
    with_pieces: bool | None = None  # llama.cpp: return [{"id", "piece"}]
    # with ``messages``: the prompt a chat request with these tools renders (vLLM takes them too)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[NonNegInt]


_AT = re.compile(r"at `\$(?P<path>[^`]*)`")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def param_from_msgspec(message: str) -> str | None:
    """``"Expected `int` >= 1 - at `$.max_tokens`"`` -> ``"max_tokens"``; ``$.messages[0]`` +
    missing ``role`` -> ``"messages[0].role"``; an error at the root -> None."""
    m = _AT.search(message)
    path = m.group("path") if m else ""
    path = path[1:] if path.startswith(".") else path
    miss = _MISSING.search(message)
    if miss:
        path = f"{path}.{miss.group('field')}" if path else miss.group("field")
    return path or None
