"""Turn a decoded OpenAI body into an engine ``GenerateRequest`` (or a 400 naming the field).

Served: ``n`` up to ``server.max_n`` (n independent sequences of the prompt, each its own prefill:
there is no KV fork on this runtime, spec §9.3; choice i > 0 uses a seed derived from ``seed``), a
completion's ``prompt`` as a list of prompts (strings or token-id lists, up to
``server.max_prompts``: each prompt its own request, n choices each),
``presence_penalty``/``frequency_penalty``/``repetition_penalty``/``logit_bias``/``min_p``/``top_k``
(the batched sampler's processors, ``engine/logits.py``), ``response_format`` ``json_object`` /
``json_schema`` and vLLM's / llama.cpp's structured outputs (constrained decoding,
``api/structured.py``, ``engine/grammar.py``), and on chat ``tools`` /
``tool_choice`` / ``parallel_tool_calls`` and tool messages (``api/tools.py``; the prompt:
``api/chat_prompt.py``). ``suffix``
on a fill-in-the-middle model (its FIM tokens: ``models/fim.py``; the prompt is the prefix), and
vLLM's ``truncate_prompt_tokens`` (a completion's prompts: ``api/prompts.py``). Rejected because
they would change results: ``best_of``>1 (no fork), ``suffix`` on other models or with ``echo``, the
legacy ``functions``/``function_call``, ``tools`` on completions or with another constraint,
non-text content parts, and ``min_tokens``/``ignore_eos`` with a constraint or ``tools``
(they sample past where the grammar ends). ``echo`` prepends the prompt text; with ``logprobs``
the prompt is scored too (``SamplingParams.prompt_logprobs``: its entries come first in
``logprobs``) and ``max_tokens`` may be 0. vLLM's ``prompt_logprobs`` (k) scores it the same way
and answers in vLLM's shape (a ``prompt_logprobs`` list per completion choice, one per chat
response; not streamed).

Hostile sizes (README "Per-request limits and slow readers"): a prompt longer than the context can
hold is refused before any tokenizing (text: :func:`calserve.api.tokenizing.check_text_fits`;
token ids: their count; unless ``truncate_prompt_tokens`` keeps only the end: then the body's
size bounds it), and :func:`prepare_body` decodes and prepares a big body in the prompt
worker thread, so the trio thread never tokenizes more than a small body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from calserve import errors as E
from calserve.api.bodies import decode
from calserve.api.chat_prompt import chat_input, render_chat, template_variables
from calserve.api.infill import InfillBody, InfillInfo, infill_request
from calserve.api.prompts import (
    batched, check_token_ids, context_full, fim_of, prompt_ids, prompt_list, truncation, vocab_size,
)
from calserve.api.protocol import TokenizerLike
from calserve.api.schemas import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatBody,
    CompletionBody,
    SamplingFields,
)
from calserve.api.tokenizing import INLINE_BODY_BYTES, run_in_worker
from calserve.api.reasoning import Answer, Reasoning
from calserve.api.errors import ApiError
from calserve.api.response_store import ResponseStore
from calserve.api.responses import ResponseEcho, ResponsesBody, chat_body, renamed
from calserve.api.structured import answer_grammar, constraint_of
from calserve.engine.grammar import Grammar
from calserve.engine.sampler import MIN_TEMPERATURE
from calserve.engine.types import GenerateRequest, ModelInfo, SamplingParams

__all__ = ["Prepared", "ModelsLike", "ModelView", "resolve_model", "prepare_completion",
           "prepare_chat", "prepare_responses", "prepare_infill", "prepare_body", "choice_seed",
           "Kind"]

Kind = Literal["completion", "chat", "responses", "infill"]

# A body holding one of these may ask for a grammar (compiling one can take milliseconds: it is
# prepared in the worker thread)
_GRAMMAR_MARKS = (b"json_", b'"tools"', b"guided_", b"structured_outputs", b'"grammar"')
_OFF_LOOP_MARKS = (*_GRAMMAR_MARKS, b"previous_response_id")


@dataclasses.dataclass(frozen=True)
class Prepared:
    kind: Literal["completion", "chat"]
    alias: str
    request: GenerateRequest
    stream: bool
    include_usage: bool
    echo_text: str  # "" unless completions echo=true
    logprobs: int | None  # None = none; k = chosen + top-k
    n: int = 1  # choices per prompt: n independent sequences (``choice_requests``)
    # /v1/completions with a list of prompts: the request and echo text of each prompt after the
    # first (``request`` / ``echo_text``); their choices follow the first prompt's
    more_prompts: tuple[tuple[GenerateRequest, str], ...] = ()
    # chat with tools or a thinking model: how the answer is shaped (tool calls, reasoning)
    answer: Answer | None = None
    # /v1/responses: the chat request it means answers as a Responses object (api/responses.py)
    responses: ResponseEcho | None = None
    # vLLM's ``prompt_logprobs`` (k); ``echo_scored``: a completion's ``echo`` with ``logprobs``
    # (the prompt's entries come first in ``logprobs``). Either makes the engine score the prompt.
    prompt_logprobs: int | None = None
    echo_scored: bool = False
    # llama.cpp's /infill: a completion answered in llama-server's shape (api/infill.py)
    infill: InfillInfo | None = None

    @property
    def choices(self) -> int:
        """The response's choices: ``n`` per prompt, prompt by prompt (OpenAI's and vLLM's order:
        choice ``k * n + j`` is choice j of prompt k)."""
        return self.n * (1 + len(self.more_prompts))

    def echo_of(self, index: int) -> str:
        """The echoed prompt text of choice ``index`` ("" unless ``echo``)."""
        k = index // self.n
        return self.echo_text if k == 0 else self.more_prompts[k - 1][1]

    def logprob_offset(self, index: int) -> int:
        """``text_offset`` of choice ``index``'s first logprob entry: 0 when the prompt is scored
        (its tokens' entries come first), else after the echoed prompt."""
        if self.echo_scored:
            return 0
        return len(self.echo_of(index))

    def scored_prompt_len(self, index: int) -> int:
        """How many of choice ``index``'s first logprob entries score its prompt (one per prompt
        token, the first null): its prompt's length when the prompt is scored, else 0."""
        if self.request.sampling.prompt_logprobs is None:
            return 0
        k = index // self.n
        req = self.request if k == 0 else self.more_prompts[k - 1][0]
        return len(req.prompt_tokens)

    def prompt_tokens(self) -> int:
        """Every prompt's tokens, each prompt once (``usage.prompt_tokens`` with ``n`` > 1)."""
        more = sum(len(r.prompt_tokens) for r, _ in self.more_prompts)
        return len(self.request.prompt_tokens) + more

    def choice_requests(self) -> list[GenerateRequest]:
        """The engine request of every choice, prompt by prompt: choice 0 of a prompt is that
        prompt's request itself (so ``n: 1`` and choice 0 of ``n: 3`` with the same seed are the
        same answer, and each prompt of a list answers as it would alone), choice j > 0 uses a seed
        derived from the request's seed (reproducible, and different from the others'), or none
        (the engine draws one) when the request has none."""
        out: list[GenerateRequest] = []
        for req in (self.request, *(r for r, _ in self.more_prompts)):
            out.append(req)
            seed = req.sampling.seed
            for j in range(1, self.n):
                s = None if seed is None else choice_seed(seed, j)
                sampling = dataclasses.replace(req.sampling, seed=s)
                out.append(dataclasses.replace(req, sampling=sampling))
        return out


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed`` (a signed 64-bit value)."""
    m = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


class ModelsLike(Protocol):
    """What preparing a request needs of the engine (``EngineLike`` has it; so does a
    :class:`ModelView` a worker thread may read)."""

    @property
    def default_alias(self) -> str: ...

    def models(self) -> Sequence[ModelInfo]: ...

    def tokenizer(self, alias: str | None = None) -> TokenizerLike: ...


@dataclasses.dataclass(frozen=True)
class ModelView:
    """The served models and their tokenizers, taken on the trio thread: a worker thread reads this
    instead of the engine (whose state the trio thread changes)."""

    default_alias: str
    infos: tuple[ModelInfo, ...]
    tokenizers: dict[str, TokenizerLike]

    @classmethod
    def of(cls, engine: ModelsLike) -> ModelView:
        infos = tuple(engine.models())
        return cls(engine.default_alias, infos, {i.alias: engine.tokenizer(i.alias) for i in infos})

    def models(self) -> Sequence[ModelInfo]:
        return self.infos

    def tokenizer(self, alias: str | None = None) -> TokenizerLike:
        return self.tokenizers[alias or self.default_alias]


def resolve_model(engine: ModelsLike, name: str | None) -> ModelInfo:
    """The ModelInfo of alias ``name`` (None/"" = the default alias); UnknownModel -> 404. An
    engine with ``model_info(alias)`` (the real one) builds that entry alone, not every served
    model's, on each request."""
    alias = name or engine.default_alias
    one: Callable[[str], ModelInfo | None] | None = getattr(engine, "model_info", None)
    if one is not None:
        found = one(alias)
        if found is not None:
            return found
    else:
        for info in engine.models():
            if info.alias == alias:
                return info
    known = ", ".join(sorted(i.alias for i in engine.models()))
    raise E.UnknownModel(f"The model `{alias}` does not exist (served: {known})", param="model")


def _reject_unsupported(body: SamplingFields, max_n: int) -> int:
    """Refuse what cannot be served; returns ``n``."""
    def bad(param: str, why: str) -> E.UnsupportedParameter:
        return E.UnsupportedParameter(f"`{param}` is not supported: {why}", param=param)

    n = body.n or 1
    if n > max_n:
        raise E.RequestError(f"`n` must be at most {max_n} (server.max_n)", param="n")
    if body.best_of not in (None, 1):
        raise bad("best_of", "only best_of=1 (no KV fork/copy on this runtime, spec §9.3)")
    if body.functions:
        raise bad("functions", "the legacy `functions` are not served: send `tools`")
    if body.function_call not in (None, "none", "auto"):
        raise bad("function_call", "the legacy `function_call` is not served: send `tool_choice`")
    if not isinstance(body, ChatBody):
        if body.tools:
            raise bad("tools", "tool calling is served on /v1/chat/completions")
        if body.tool_choice not in (None, "none", "auto"):
            raise bad("tool_choice", "tool calling is served on /v1/chat/completions")
    return n


def _stop(body: SamplingFields) -> tuple[str, ...]:
    stop = body.stop
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP_STRINGS:
        raise E.RequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    for i, s in enumerate(items):
        if s == "":
            raise E.RequestError("stop strings must not be empty", param="stop")
        if len(s) > MAX_STOP_CHARS:
            raise E.RequestError(f"a stop string has at most {MAX_STOP_CHARS} characters",
                                 param="stop" if isinstance(stop, str) else f"stop[{i}]")
    return tuple(items)


def _logit_bias(body: SamplingFields, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """``{"50256": -100, ...}`` -> ((50256, -100.0), ...) sorted by id; ids in the vocabulary,
    biases finite in [-100, 100] (OpenAI's bounds)."""
    if not body.logit_bias:
        return ()
    out: dict[int, float] = {}
    for key, v in body.logit_bias.items():
        where = f"logit_bias[{key[:32]}]"
        try:
            t = int(key)
        except ValueError:
            raise E.RequestError(f"`logit_bias` keys must be token ids, got {key[:32]!r}",
                                 param=where) from None
        if t < 0 or (vocab is not None and t >= vocab):
            limit = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise E.RequestError(f"`logit_bias` token {t} is not a token id in {limit}",
                                 param=where)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise E.RequestError("`logit_bias` values must be numbers in [-100, 100]", param=where)
        out[t] = float(v)
    return tuple(sorted(out.items()))


def _sampling(
    body: SamplingFields, *, prompt_len: int, max_seq: int, max_tokens: int | None,
    default_max: int, logprobs: int | None, prompt_param: str, vocab: int | None,
    tok: TokenizerLike | None = None, grammar: Grammar | None = None,
) -> SamplingParams:
    """``grammar``: the answer's grammar when the request has one besides ``response_format``
    (tools)."""
    mt = _max_tokens(body, prompt_len=prompt_len, max_seq=max_seq, max_tokens=max_tokens,
                     default_max=default_max, prompt_param=prompt_param)
    min_tokens = body.min_tokens or 0
    top_k = body.top_k or 0
    if top_k < 0 or (vocab is not None and top_k >= vocab):
        top_k = 0  # a k that keeps the whole vocabulary is no cut-off
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0  # greedy: dividing by a subnormal temperature overflows
    if grammar is None:  # response_format, or vLLM's / llama.cpp's structured outputs
        grammar = answer_grammar(body, tok, vocab or 0)
    return SamplingParams(
        temperature=temperature,
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=top_k,
        seed=body.seed,
        max_tokens=mt,
        min_tokens=min_tokens,
        ignore_eos=bool(body.ignore_eos),
        stop=_stop(body),
        include_stop_str=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False,
        stop_token_ids=frozenset(check_token_ids(body.stop_token_ids or (), vocab, "stop_token_ids")),
        logprobs=logprobs,
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
        logit_bias=_logit_bias(body, vocab),
        min_p=float(body.min_p or 0.0),
        grammar=grammar,
        allowed_token_ids=tuple(sorted(set(check_token_ids(
            body.allowed_token_ids or (), vocab, "allowed_token_ids")))),
    )


def _max_tokens(body: SamplingFields, *, prompt_len: int, max_seq: int, max_tokens: int | None,
                default_max: int, prompt_param: str) -> int:
    """The completion's token budget for a prompt of ``prompt_len`` tokens (400 when the prompt
    leaves no room, or the asked budget does not fit, or ``min_tokens`` exceeds it)."""
    if prompt_len >= max_seq:
        raise context_full(max_seq, prompt_len, prompt_param)
    room = max_seq - prompt_len
    mt = max_tokens if max_tokens is not None else min(default_max, room)
    if mt > room:
        raise E.RequestError(
            f"This model's maximum context length is {max_seq} tokens; you requested"
            f" {prompt_len + mt} tokens ({prompt_len} in the prompt, {mt} in the completion)"
            " (context length exceeded)",
            param="max_completion_tokens" if isinstance(body, ChatBody)
            and body.max_completion_tokens is not None else "max_tokens",
        )
    min_tokens = body.min_tokens or 0
    if min_tokens > mt:
        raise E.RequestError(
            f"`min_tokens` ({min_tokens}) must be <= the maximum tokens ({mt})", param="min_tokens"
        )
    return mt


def _stream_flags(body: SamplingFields) -> tuple[bool, bool]:
    stream = bool(body.stream)
    usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream_options is not None and not stream:
        raise E.RequestError("`stream_options` is only allowed when `stream` is true",
                             param="stream_options")
    return stream, usage


def prepare_completion(
    engine: ModelsLike, body: CompletionBody, tenant: str, max_n: int = 1, max_prompts: int = 1
) -> Prepared:
    n = _reject_unsupported(body, max_n)
    if body.suffix and body.echo:
        raise E.RequestError("`suffix` cannot be combined with `echo` (the answer is the middle"
                             " between the prompt and the suffix)", param="suffix")
    scored = bool(body.echo) and body.logprobs is not None  # the prompt's own logprobs too
    plp = _prompt_logprobs(body)
    if body.max_tokens == 0 and not scored and plp is None:
        raise E.RequestError("`max_tokens` must be >= 1 (0 only with `echo` and `logprobs`, or"
                             " `prompt_logprobs`: the prompt scored, nothing generated)",
                             param="max_tokens")
    info = resolve_model(engine, body.model)
    tok = engine.tokenizer(info.alias)
    fim = fim_of(tok, info, body.suffix) if body.suffix else None
    items = prompt_list(body.prompt, max_prompts)
    params = [f"prompt[{i}]" for i in range(len(items))] if batched(body.prompt) else ["prompt"]
    keep = truncation(body, info)
    if keep is not None and fim is not None:
        raise E.RequestError("`truncate_prompt_tokens` cannot be combined with `suffix` (the"
                             " fill-in-the-middle prompt is the prefix and the suffix together)",
                             param="truncate_prompt_tokens")
    prompts = [(prompt_ids(tok, info, p, param, body.echo, fim, keep), param)
               for p, param in zip(items, params)]
    stream, usage = _stream_flags(body)
    (ids, _), param = prompts[0]
    sampling = _sampling(
        body, prompt_len=len(ids), max_seq=info.max_seq, max_tokens=body.max_tokens,
        default_max=16, logprobs=body.logprobs, prompt_param=param,
        vocab=vocab_size(tok, info), tok=tok,
    )
    if fim is not None and fim[0].ends and not body.ignore_eos:  # they end a FIM completion
        sampling = dataclasses.replace(
            sampling, stop_token_ids=frozenset(sampling.stop_token_ids).union(fim[0].ends))
    if scored or plp is not None:  # one scoring pass serves both: the larger top-k
        k = max(body.logprobs if scored and body.logprobs is not None else 0, plp or 0)
        sampling = dataclasses.replace(sampling, prompt_logprobs=k)
    reqs = []
    for k, ((p_ids, p_text), p_param) in enumerate(prompts):
        s = sampling if k == 0 else dataclasses.replace(sampling, max_tokens=_max_tokens(
            body, prompt_len=len(p_ids), max_seq=info.max_seq, max_tokens=body.max_tokens,
            default_max=16, prompt_param=p_param))
        reqs.append((GenerateRequest(prompt_tokens=p_ids, sampling=s, model=info.alias,
                                     tenant=tenant, user=body.user), p_text if body.echo else ""))
    return Prepared("completion", info.alias, reqs[0][0], stream, usage, reqs[0][1], body.logprobs,
                    n, tuple(reqs[1:]), prompt_logprobs=plp, echo_scored=scored)


def _prompt_logprobs(body: SamplingFields) -> int | None:
    """vLLM's ``prompt_logprobs`` (k in [0, 20], the schema's bound), refused with ``stream`` (the
    entries are part of the whole answer, as in vLLM)."""
    if body.prompt_logprobs is not None and body.stream:
        raise E.RequestError("`prompt_logprobs` are not available when `stream` is true",
                             param="prompt_logprobs")
    return body.prompt_logprobs


def prepare_chat(engine: ModelsLike, body: ChatBody, tenant: str, max_n: int = 1) -> Prepared:
    n = _reject_unsupported(body, max_n)
    if body.top_logprobs is not None and not body.logprobs:
        raise E.RequestError("`top_logprobs` requires `logprobs: true`", param="top_logprobs")
    info = resolve_model(engine, body.model)
    tok = engine.tokenizer(info.alias)
    tools, msgs, shown = chat_input(tok, body)
    keep = truncation(body, info)
    prompt, ids = render_chat(tok, msgs, body.add_generation_prompt is not False,
                              info.max_seq if keep is None else None, shown,
                              template_variables(body.chat_template_kwargs))
    if not ids:
        raise E.RequestError("`messages` render to zero tokens", param="messages")
    if keep is not None and len(ids) > keep:
        ids = ids[-keep:]  # vLLM's truncate_prompt_tokens: the rendered conversation's end
    reasoning = Reasoning.of(prompt, getattr(tok, "reasoning_tags", False), body.reasoning_format)
    grammar = None
    if tools is not None:
        other = constraint_of(body)
        if other is not None:
            raise E.UnsupportedParameter(f"`{other[0]}` cannot be combined with `tools` (the"
                                         " answer's format is the tool-call format)",
                                         param=other[0])
        for name in ("min_tokens", "ignore_eos"):  # refused before the grammar is compiled
            if getattr(body, name):
                raise E.UnsupportedParameter(f"`{name}` is not supported with `tools` (it would"
                                             " sample past the end of the answer)", param=name)
        think = None if reasoning is None else "open" if reasoning.opened else "optional"
        grammar = tools.grammar(tok, vocab_size(tok, info) or 0, think)
    stream, usage = _stream_flags(body)
    plp = _prompt_logprobs(body)
    k = (body.top_logprobs or 0) if body.logprobs else None
    mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = _sampling(
        body, prompt_len=len(ids), max_seq=info.max_seq, max_tokens=mt,
        default_max=info.max_seq, logprobs=k, prompt_param="messages",
        vocab=vocab_size(tok, info), tok=tok, grammar=grammar,
    )
    if plp is not None:
        sampling = dataclasses.replace(sampling, prompt_logprobs=plp)
    req = GenerateRequest(prompt_tokens=ids, sampling=sampling, model=info.alias, tenant=tenant,
                          user=body.user)
    answer = None if tools is None and reasoning is None else Answer(tools, reasoning)
    return Prepared("chat", info.alias, req, stream, usage, "", k, n, answer=answer,
                    prompt_logprobs=plp)


def prepare_infill(engine: ModelsLike, body: InfillBody, tenant: str) -> Prepared:
    """llama.cpp's ``/infill`` as the token-prompt completion it means (``api/infill.py``)."""
    info = resolve_model(engine, body.model)
    tok = engine.tokenizer(info.alias)
    comp, infill = infill_request(tok, getattr(tok, "fim", None), info.alias, info.max_seq, body)
    return dataclasses.replace(prepare_completion(engine, comp, tenant), infill=infill)


def prepare_responses(engine: ModelsLike, body: ResponsesBody, tenant: str,
                      store: ResponseStore | None = None) -> Prepared:
    """The chat request a Responses body means, prepared as one; errors name the Responses
    field (``api/responses.py``). ``store``: the stored responses (None: none are kept), where
    ``previous_response_id`` is looked up (file I/O: :func:`prepare_body` runs this in the
    prompt worker thread then)."""
    previous = None
    rid = body.previous_response_id
    if rid is not None:
        if store is None:
            raise E.UnsupportedParameter(
                "`previous_response_id` is not supported: responses are not stored on this server"
                " (server.responses_store is off); send the whole conversation in `input`",
                param="previous_response_id")
        previous = store.context(tenant, rid)
        if previous is None:
            raise ApiError(400, f"Previous response with id '{rid}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
    chat, echo = chat_body(body, previous, store is not None and body.store is not False)
    try:
        prep = prepare_chat(engine, chat, tenant)
    except E.CalserveError as exc:
        raise renamed(exc, echo.sources) from None
    return dataclasses.replace(prep, responses=echo)


def _prepare(kind: Kind, engine: ModelsLike, data: bytes, tenant: str, max_n: int,
             max_prompts: int, store: ResponseStore | None) -> Prepared:
    if kind == "completion":
        return prepare_completion(engine, decode(CompletionBody, data), tenant, max_n, max_prompts)
    if kind == "responses":
        return prepare_responses(engine, decode(ResponsesBody, data), tenant, store)
    if kind == "infill":
        return prepare_infill(engine, decode(InfillBody, data), tenant)
    return prepare_chat(engine, decode(ChatBody, data), tenant, max_n)


async def prepare_body(kind: Kind, engine: ModelsLike, data: bytes,
                       tenant: str, max_n: int = 1, max_prompts: int = 1,
                       store: ResponseStore | None = None) -> Prepared:
    """Decode and prepare a generation body (400/404 raise here): on the trio thread when it is
    small (:data:`~calserve.api.tokenizing.INLINE_BODY_BYTES`), asks for no constrained
    decoding (``response_format`` or ``tools``: compiling a grammar can take milliseconds) and
    names no stored response (``previous_response_id``: a read of the ``store``'s file), else in
    the prompt worker thread over a :class:`ModelView` of the engine."""
    if len(data) <= INLINE_BODY_BYTES and not any(m in data for m in _OFF_LOOP_MARKS):
        return _prepare(kind, engine, data, tenant, max_n, max_prompts, store)
    view = ModelView.of(engine)
    return await run_in_worker(lambda: _prepare(kind, view, data, tenant, max_n, max_prompts,
                                                store))
