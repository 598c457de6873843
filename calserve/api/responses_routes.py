"""The stored responses' routes (``api/response_store.py``), as OpenAI's Responses API has them:

- ``GET /v1/responses/{id}``: the response object as it was answered;
- ``DELETE /v1/responses/{id}``: ``{"id", "object": "response", "deleted": true}``;
- ``GET /v1/responses/{id}/input_items``: the conversation the response answered, as a list
  page (``limit`` 1–100, default 20; ``order`` ``desc`` (default) or ``asc``; ``after``: an
  item id, the page starts after it): ``{"object": "list", "data", "first_id", "last_id",
  "has_more"}``.

A response another tenant stored, an expired, deleted or unknown one: 404 naming
``response_id``. With ``server.responses_store`` off every id is unknown. The store's file is
read in a trio worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from quart import Response, request
from quart_trio import QuartTrio

from calserve import errors as E
from calserve.api.errors import ApiError
from calserve.api.response_store import ResponseStore, run_store
from calserve.api.routes import json_response
from calserve.api.state import ApiState

__all__ = ["register_response_routes", "input_items_page"]

MAX_LIMIT = 100
T = TypeVar("T")


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="not_found")


def input_items_page(items: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    """One page of a response's input items (module docstring); ``args``: the query string."""
    raw = args.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise E.RequestError(f"`limit` must be an integer from 1 to {MAX_LIMIT}, not {raw!r}",
                             param="limit")
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise E.RequestError(f"`order` must be 'asc' or 'desc', not {order!r}", param="order")
    seq = items if order == "asc" else items[::-1]
    after = args.get("after")
    if after is not None:
        ids = [it.get("id") for it in seq]
        if after not in ids:
            raise E.RequestError(f"`after`: no input item {after!r} in this response",
                                 param="after")
        seq = seq[ids.index(after) + 1:]
    page = seq[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None,
            "has_more": len(seq) > limit}


def register_response_routes(app: QuartTrio, state: ApiState) -> None:
    def tenant() -> str:
        return state.tenant_of(request.headers.get("Authorization", ""))

    def store_of(response_id: str) -> ResponseStore:
        store = state.responses_store()
        if store is None:
            raise _not_found(response_id)
        return store

    async def read(response_id: str, what: Callable[[ResponseStore, str], T | None]) -> T:
        """``what(store, tenant)`` of the stored response (a worker thread), or its 404."""
        who = tenant()
        store = store_of(response_id)
        found = await run_store(lambda: what(store, who))
        if found is None:
            raise _not_found(response_id)
        return found

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        return json_response(await read(response_id, lambda s, who: s.get(who, response_id)))

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        await read(response_id, lambda s, who: s.delete(who, response_id) or None)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/<response_id>/input_items")
    async def input_items(response_id: str) -> Response:
        items = await read(response_id, lambda s, who: s.input_items(who, response_id))
        return json_response(input_items_page(items, request.args))
