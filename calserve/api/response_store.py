"""Stored responses of ``POST /v1/responses`` (``store``, ``previous_response_id``, ``GET`` /
``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``).

OpenAI's Responses API keeps a response (``store``, true unless the request says false) so that
a follow-up can name it (``previous_response_id``) instead of resending the conversation, and so
that it can be read back or deleted. Each stored response keeps:

- the response object as it was answered (streamed: the terminal event's ``response``);
- its input items: the conversation it answered (its previous response's input items and output
  items, then its own ``input``, each with an ``id``), without ``instructions`` (OpenAI does not
  carry a previous response's instructions over either).

A follow-up's conversation is its previous response's input items, that response's output items,
then its own input (:meth:`ResponseStore.context`).

Where: one SQLite file (stdlib ``sqlite3``, WAL journal, a busy timeout), by default
``CALSERVE_HOME/state/responses.sqlite3`` for the server (``server.responses_store_path``;
``":memory:"`` keeps them in the process). Several calserve processes on one host (one per board
behind HAProxy, ``deploy/``) share the file, so a follow-up may land on any of them. Bounded:
entries older than ``server.responses_ttl_s`` are gone, and only the last
``server.responses_max_stored`` stored are kept (older ones go first). A response is seen only by the tenant that created it (another tenant's id
is "not found", as an unknown one). The methods block (file I/O): the routes call them in a trio
worker thread (:func:`run_store`), never on the event loop.

A response is stored before its last byte is sent (the JSON body, or the stream's terminal
event), so a client that got it may name it at once. A store that fails (disk full, locked for
longer than the timeout) is logged and counted (``calserve_responses_stored_total{outcome="error"}``);
the answer still goes out, and a follow-up naming it gets the 400 of an unknown id. A read that
fails (``previous_response_id``, ``GET``, ``DELETE``) is a 503 ``store_unavailable`` with
Retry-After, never a 500.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar, final

import msgspec
import trio

from calserve.api.errors import ApiError
from calserve.api.render import new_id

__all__ = ["ResponseStore", "run_store", "with_ids", "store_unavailable"]

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    created REAL NOT NULL,
    response BLOB NOT NULL,
    input_items BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""

#: What a stored response's items look like in the file (JSON, like the API's).
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(list[dict[str, Any]])
_dec_obj = msgspec.json.Decoder(dict[str, Any])

T = TypeVar("T")

_ITEM_PREFIX: Final = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                       "reasoning": "rs"}


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` as OpenAI's input item list shows them: each with an ``id`` (a new one for those
    sent without), a message's ``type`` written out and its text content as one text part."""
    out = []
    for it in items:
        kind = it.get("type") or ("message" if "role" in it else None)
        item = dict(it)
        if kind == "message":
            item["type"] = "message"
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
        if not isinstance(item.get("id"), str):
            item = {"id": new_id(_ITEM_PREFIX.get(kind or "", "item")), **item}
        out.append(item)
    return out


def store_unavailable(exc: BaseException) -> ApiError:
    """The store's file cannot be read or written: a 503 for the request that needed it."""
    return ApiError(503, f"the stored responses cannot be read or written: {exc}",
                    type="service_unavailable", code="store_unavailable", retry_after=1.0)


@final
class ResponseStore:
    """The stored responses (module docstring). Thread-safe: one connection, one lock (the
    routes' worker threads and a test's thread may call it at once)."""

    def __init__(self, path: str | Path, ttl_s: float, max_stored: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = str(path)
        self.ttl_s = ttl_s
        self.max_stored = max_stored
        self._clock = clock
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    @contextlib.contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        """The connection (opened at first use), under the lock; a failure of the file or the
        database is :func:`store_unavailable`."""
        with self._lock:
            try:
                yield self._open()
            except (sqlite3.Error, OSError) as exc:
                raise store_unavailable(exc) from exc

    def _open(self) -> sqlite3.Connection:
        db = self._db
        if db is None:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=5.0, check_same_thread=False,
                                 isolation_level=None)
            if self.path != ":memory:":
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            self._db = db
        return db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def put(self, tenant: str, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Keep ``response`` (its ``id``) with the conversation it answered; then drop what is
        past the TTL and what the last ``max_stored`` puts (of any process on the file) pushed
        out, oldest first."""
        now = self._clock()
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                cur = db.execute("INSERT OR REPLACE INTO responses (id, tenant, created, response,"
                                 " input_items) VALUES (?, ?, ?, ?, ?)",
                                 (response["id"], tenant, now, _enc.encode(response),
                                  _enc.encode(input_items)))
                db.execute("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))
                # the last max_stored puts stay (seq never repeats: AUTOINCREMENT); an index range
                last = cur.lastrowid
                assert last is not None  # an INSERT sets it
                db.execute("DELETE FROM responses WHERE seq <= ?", (last - self.max_stored,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _row(self, tenant: str, response_id: str) -> tuple[bytes, bytes] | None:
        with self._conn() as db:
            row = db.execute(
                "SELECT response, input_items FROM responses WHERE id = ? AND tenant = ?"
                " AND created >= ?", (response_id, tenant, self._clock() - self.ttl_s)).fetchone()
        return None if row is None else (row[0], row[1])

    def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        """The response object, or None (unknown, expired, deleted, or another tenant's)."""
        row = self._row(tenant, response_id)
        return None if row is None else _dec_obj.decode(row[0])

    def input_items(self, tenant: str, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation the response answered (its input items), or None."""
        row = self._row(tenant, response_id)
        return None if row is None else _dec.decode(row[1])

    def context(self, tenant: str, response_id: str) -> list[dict[str, Any]] | None:
        """What a follow-up naming the response continues: its input items, then its output
        items; None when there is no such response for this tenant."""
        row = self._row(tenant, response_id)
        if row is None:
            return None
        return [*_dec.decode(row[1]), *_dec_obj.decode(row[0]).get("output", [])]

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget the response; False when there was none for this tenant (or it expired)."""
        with self._conn() as db:
            cur = db.execute("DELETE FROM responses WHERE id = ? AND tenant = ? AND created >= ?",
                             (response_id, tenant, self._clock() - self.ttl_s))
        return cur.rowcount > 0

    def __len__(self) -> int:
        with self._conn() as db:
            return int(db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])


async def run_store(fn: Callable[[], T]) -> T:
    """``fn`` (a store call: file I/O) in a trio worker thread."""
    return await trio.to_thread.run_sync(fn)
