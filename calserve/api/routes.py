"""The quart routes: models, tokenize/detokenize, health/ready, metrics (and the JSON responses).

The generation routes (``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST
/v1/responses``) are served by :mod:`calserve.api.asgi` in front of quart; quart knows their paths only so that other methods on
them are answered like on any route (405 with ``Allow``, automatic OPTIONS).

``/tokenize`` and ``/detokenize`` do work proportional to their body: a big body is decoded,
tokenized (or detokenized) and encoded in the prompt worker thread
(:mod:`calserve.api.tokenizing`), and a text longer than the model's context can hold is refused
before tokenizing (400 naming the field), as for the generation routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from calserve import __version__
from calserve import errors as E
from calserve.api.asgi import FAST_ROUTES
from calserve.api.bodies import check_declared, decode, too_large
from calserve.api.chat_prompt import chat_input, render_chat, template_variables
from calserve.api.convert import ModelView, resolve_model
from calserve.api.prompts import check_token_ids
from calserve.api.errors import ApiError, retry_after_header
from calserve.api.metrics import CONTENT_TYPE, version_info
from calserve.api.protocol import TokenizerLike
from calserve.api.readiness import RETRY_AFTER_S, not_ready_reason
from calserve.api.schemas import DetokenizeBody, TokenizeBody
from calserve.api.state import ApiState
from calserve.api.tokenizing import INLINE_BODY_BYTES, check_text_fits, encode_text, run_in_worker

__all__ = ["register_routes", "json_response", "error_response"]

#: The bodies of the tokenizer routes (both name a ``model``).
_TokBody = TypeVar("_TokBody", TokenizeBody, DetokenizeBody)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status=status, headers=headers,
                    content_type="application/json")


def error_response(err: ApiError) -> Response:
    return json_response(err.response_body(), err.status, err.headers())


async def _served_by_asgi() -> NoReturn:
    """Never reached: ``CalserveApp`` hands every POST that quart would route here to
    ``FastRoutes`` first (``asgi.fast_route`` matches as quart does)."""
    raise RuntimeError("a generation route reached quart; calserve.api.asgi serves it")


def _ready_alias(eng: Any) -> Any:
    """The alias ``/ready`` without ``model`` reports: the default one while it is served and
    Ready, else the first Ready (or servable non-resident) alias, else the default (or, once it was
    unloaded, the first listed): the server is ready while any alias can be served."""
    infos = list(eng.models())
    default = next((i for i in infos if i.alias == eng.default_alias), None)
    if default is not None and eng.ready(default.alias):
        return default
    for info in infos:
        if eng.ready(info.alias):
            return info
    if default is not None or not infos:
        return resolve_model(eng, None)
    return infos[0]


def register_routes(app: QuartTrio, state: ApiState) -> None:  # noqa: C901 - a route table
    engine = state.engine

    def tenant() -> str:
        return state.tenant_of(request.headers.get("Authorization", ""))

    async def raw_body() -> bytes:
        limit = state.config.server.max_body_bytes
        check_declared(request.content_length, limit)
        data = await request.get_data(cache=False, as_text=False)
        if len(data) > limit:
            raise too_large(limit)
        return data if isinstance(data, bytes) else data.encode()

    for path, kind in FAST_ROUTES.items():
        app.add_url_rule(path, f"generation_{kind}", _served_by_asgi, methods=["POST"])

    def model_card(info: Any) -> dict[str, Any]:
        return {
            "id": info.alias, "object": "model", "created": info.created, "owned_by": "calserve",
            "generation": info.generation, "state": info.state, "max_model_len": info.max_seq,
            "package_sha256": info.package_sha256, "server_version": __version__,
            "profiles": [{"compiled_batch": p.compiled_batch, "tier": p.tier,
                          "available": p.available} for p in info.profiles],
        }

    @app.get("/v1/models")
    async def models() -> Response:
        tenant()
        return json_response({"object": "list",
                              "data": [model_card(i) for i in engine().models()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        tenant()
        return json_response(model_card(resolve_model(engine(), model_id)))

    async def tokenizer_route(kind: type[_TokBody],
                              work: Callable[[_TokBody, Any, TokenizerLike], Any]) -> Response:
        """The tokenizer routes: tenant, body, its model; then ``work(body, info, tokenizer)``
        and the JSON encoding of its answer, in the prompt worker thread for a big body."""
        tenant()
        data = await raw_body()
        view = ModelView.of(engine())

        def job() -> bytes:
            b = decode(kind, data)
            info = resolve_model(view, b.model)
            return msgspec.json.encode(work(b, info, view.tokenizer(info.alias)))

        out = job() if len(data) <= INLINE_BODY_BYTES else await run_in_worker(job)
        return Response(out, status=200, content_type="application/json")

    def tokenize_work(b: TokenizeBody, info: Any, tok: TokenizerLike) -> dict[str, Any]:
        given = [n for n in ("prompt", "content", "messages") if getattr(b, n) is not None]
        if len(given) != 1:
            raise E.RequestError("send exactly one of `prompt`, `content` or `messages`",
                                 param=given[1] if len(given) > 1 else "prompt")
        prompt: str | None = None  # with `messages`: the rendered conversation (chat template)
        if b.messages is not None:
            _, msgs, shown = chat_input(tok, b)  # with tools: the prompt the chat request has
            prompt, ids = render_chat(tok, msgs, b.add_generation_prompt is not False,
                                      info.max_seq, shown,
                                      template_variables(b.chat_template_kwargs))
        elif b.tools is not None:
            raise E.RequestError("`tools` go with `messages`", param="tools")
        else:
            text = b.prompt if b.prompt is not None else b.content
            assert text is not None
            check_text_fits(tok, info.max_seq, len(text), given[0], "the text")
            # as a completion's prompt (BOS when the model expects it) unless add_special_tokens
            # is false (vLLM's field)
            ids = encode_text(tok, text, prompt=b.add_special_tokens is not False)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": info.max_seq,
                               "tokens": list(ids)}
        if b.with_pieces:
            out["tokens"] = [{"id": i, "piece": tok.decode([i])} for i in ids]
        if prompt is not None:
            out["prompt"] = prompt
        return out

    def detokenize_work(b: DetokenizeBody, info: Any, tok: TokenizerLike) -> dict[str, Any]:
        vocab = info.extra.get("vocab_size", getattr(tok, "vocab_size", None))
        ids = check_token_ids(b.tokens, vocab if isinstance(vocab, int) else None, "tokens")
        try:
            text = tok.decode(list(ids))
        except (ValueError, OverflowError, TypeError, IndexError) as e:
            raise E.RequestError(f"cannot detokenize: {e}", param="tokens") from None
        return {"prompt": text, "content": text}

    @app.post("/tokenize")
    async def tokenize() -> Response:
        return await tokenizer_route(TokenizeBody, tokenize_work)

    @app.post("/detokenize")
    async def detokenize() -> Response:
        return await tokenizer_route(DetokenizeBody, detokenize_work)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 whenever the process serves HTTP (also while the model loads)."""
        host = state.host
        status = "ok"
        if host is None or host.engine is None:
            status = "failed" if host is not None and host.failed.is_set() else "starting"
        return json_response({"status": "alive", "engine": status, "version": __version__})

    @app.get("/version")
    async def version() -> Response:
        return json_response(version_info())

    @app.get("/ready")
    async def ready() -> Response:
        alias = request.args.get("model") or None
        host = state.host
        if host is not None and host.draining:  # SIGTERM: out of rotation at once
            drain_body, drain_headers = host.drain_status()
            return json_response(drain_body, 503, drain_headers)
        eng = host.engine if host is not None else None
        body_: dict[str, Any] = {}
        ok = False
        if eng is not None:
            info = _ready_alias(eng) if alias is None else resolve_model(eng, alias)
            ok = bool(eng.ready(info.alias))
            body_ = {"model": info.alias, "generation": info.generation, "state": info.state}
        reason = not_ready_reason(host, eng, body_.get("state"), ok)
        if reason is None:
            return json_response({"status": "ready", **body_})
        return json_response({"status": "not_ready", "reason": reason, **body_}, 503,
                             {"Retry-After": retry_after_header(RETRY_AFTER_S[reason])})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), status=200, content_type=CONTENT_TYPE)
