"""Stored responses (api/response_store.py, api/responses_routes.py): ``store``,
``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}`` and its ``input_items``.

The store against a dict model (a hypothesis state machine: puts, deletes, reads by tenant, the
clock past the TTL, the count bound); two stores (one in another process) on one file see each
other's responses (replicas of one host); a follow-up naming a response is answered exactly as
the whole conversation sent again (same prompt tokens, same greedy text), streamed or not, calls
and their results included; tenants see only their own; ``store: false`` and a server that
stores nothing; the input item pages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from calserve.api.app import get_state
from calserve.api.response_store import ResponseStore

from .conftest import make_config
from .real_engine import api_source, real_app
from .test_responses import check_events, events

R = "/v1/responses"


# ------------------------------------------------------------------------------ the store
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class StoreMachine(RuleBasedStateMachine):
    """The store is a dict by (tenant, id) of the responses put within the TTL among the last
    ``max_stored`` puts, less the deleted ones."""

    TTL = 100.0
    MAX = 5

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.store = ResponseStore(":memory:", self.TTL, self.MAX, clock=self.clock)
        self.model: dict[str, tuple[str, float, dict[str, Any], list[dict[str, Any]]]] = {}
        self.order: list[str] = []  # ids, oldest put first
        self.n = 0

    def _expire(self, now: float) -> None:
        for rid in [r for r, v in self.model.items() if v[1] < now - self.TTL]:
            del self.model[rid]
        self.order = [r for r in self.order if r in self.model]

    @rule(tenant=st.sampled_from(["a", "b"]), k=st.integers(0, 3))
    def put(self, tenant: str, k: int) -> None:
        self.n += 1
        rid = f"resp-{self.n}"
        resp = {"id": rid, "output": [{"type": "message", "k": k}], "status": "completed"}
        items = [{"id": f"msg-{self.n}-{i}", "type": "message"} for i in range(k)]
        self.store.put(tenant, resp, items)
        self.model[rid] = (tenant, self.clock.t, resp, items)
        self.order.append(rid)
        self._expire(self.clock.t)
        for old in [r for r in self.order if int(r.split("-")[1]) <= self.n - self.MAX]:
            del self.model[old]
            self.order.remove(old)

    @rule(dt=st.floats(0, 60))
    def tick(self, dt: float) -> None:
        self.clock.t += dt

    @rule(tenant=st.sampled_from(["a", "b"]), pick=st.integers(0, 20))
    def delete(self, tenant: str, pick: int) -> None:
        rid = f"resp-{pick}"
        self._expire(self.clock.t)
        there = rid in self.model and self.model[rid][0] == tenant
        assert self.store.delete(tenant, rid) == there
        if there:
            del self.model[rid]
            self.order.remove(rid)

    @rule(tenant=st.sampled_from(["a", "b"]), pick=st.integers(0, 20))
    def read(self, tenant: str, pick: int) -> None:
        rid = f"resp-{pick}"
        self._expire(self.clock.t)
        want = self.model.get(rid)
        if want is None or want[0] != tenant:
            assert self.store.get(tenant, rid) is None
            assert self.store.context(tenant, rid) is None
            return
        assert self.store.get(tenant, rid) == want[2]
        assert self.store.input_items(tenant, rid) == want[3]
        assert self.store.context(tenant, rid) == [*want[3], *want[2]["output"]]

    @invariant()
    def bounded(self) -> None:
        assert len(self.store) <= self.MAX

    def teardown(self) -> None:
        self.store.close()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_delete_answers_whether_there_was_one() -> None:
    s = ResponseStore(":memory:", 10.0, 10)
    s.put("a", {"id": "r1", "output": []}, [])
    assert not s.delete("b", "r1")  # another tenant's: not found, and still there
    assert s.get("a", "r1") is not None
    assert s.delete("a", "r1") and not s.delete("a", "r1")
    assert s.get("a", "r1") is None


_OTHER_PROCESS = """
import sys
from calserve.api.response_store import ResponseStore
s = ResponseStore(sys.argv[1], 3600.0, 100)
s.put("t", {"id": "from-child", "output": [{"type": "message"}]}, [{"id": "m1"}])
print(s.get("t", "from-parent")["output"])
"""


def test_replicas_of_one_host_share_the_file(tmp_path: Path) -> None:
    """Two processes' stores on one file (replicas behind HAProxy): each reads what the other
    kept, whichever wrote last."""
    path = tmp_path / "state" / "responses.sqlite3"
    mine = ResponseStore(path, 3600.0, 100)
    mine.put("t", {"id": "from-parent", "output": ["p"]}, [])
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(path)], check=True,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "['p']"
    assert mine.context("t", "from-child") == [{"id": "m1"}, {"type": "message"}]
    mine.close()


# ------------------------------------------------------------------------------ the routes
def _doc(**kw: Any) -> dict[str, Any]:
    return {"max_output_tokens": 6, "temperature": 0, **kw}


def _text(resp: dict[str, Any]) -> str:
    return "".join(c["text"] for i in resp["output"] if i["type"] == "message"
                   for c in i["content"])


async def _get(h: Any, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    r = await h.client.get(path, headers=headers or {})
    return r.status_code, msgspec.json.decode(await r.get_data())


async def test_a_follow_up_is_the_whole_conversation_sent_again() -> None:
    """``previous_response_id`` + input == the earlier input, the earlier output and the new
    input sent in full (prompt tokens and greedy text), streamed or not; instructions are not
    carried over; a chain of three; what is stored reads back as answered."""
    async with real_app(make_config(), sources=[api_source()]) as h:
        r1 = await h.post_ok(R, _doc(input="Hi there", instructions="Be brief."))
        assert r1["store"] is True and r1["previous_response_id"] is None
        status, got = await _get(h, f"{R}/{r1['id']}")
        assert status == 200 and got == r1
        follow = [{"role": "user", "content": "And then?"}]
        r2 = await h.post_ok(R, _doc(input=follow, previous_response_id=r1["id"]))
        assert r2["previous_response_id"] == r1["id"] and r2["instructions"] is None
        whole = [{"role": "user", "content": "Hi there"}, *r1["output"], *follow]
        again = await h.post_ok(R, _doc(input=whole, store=False))
        assert again["store"] is False
        assert r2["usage"]["input_tokens"] == again["usage"]["input_tokens"]
        assert _text(r2) == _text(again)
        # the third link, streamed: its terminal event's response is what is stored
        status, raw, _ = await h.post(R, _doc(input="Last.", previous_response_id=r2["id"],
                                              stream=True))
        assert status == 200
        r3 = check_events(events(raw))
        assert r3["previous_response_id"] == r2["id"]
        status, got = await _get(h, f"{R}/{r3['id']}")
        assert status == 200 and got == r3
        whole3 = [*whole, *r2["output"], {"role": "user", "content": "Last."}]
        again3 = await h.post_ok(R, _doc(input=whole3, store=False))
        assert r3["usage"]["input_tokens"] == again3["usage"]["input_tokens"]
        assert _text(r3) == _text(again3)
        # its input items: the whole conversation before it, oldest first with order=asc
        status, page = await _get(h, f"{R}/{r3['id']}/input_items?order=asc&limit=100")
        assert status == 200 and page["has_more"] is False
        texts = [c["text"] for i in page["data"] for c in i["content"]]
        assert texts == ["Hi there", _text(r1), "And then?", _text(r2), "Last."]
        assert all(isinstance(i["id"], str) for i in page["data"])
        assert (page["first_id"], page["last_id"]) == (page["data"][0]["id"],
                                                      page["data"][-1]["id"])


async def test_a_follow_up_carries_calls_and_their_results() -> None:
    """A stored response that ended in two function calls; the follow-up sends their outputs:
    the same prompt as the calls and outputs sent in full."""
    async with real_app(make_config(), sources=[api_source(max_seq=1024)]) as h:
        store = get_state(h.app).responses_store()
        assert store is not None
        calls = [{"type": "function_call", "id": f"fc-{k}", "call_id": f"c{k}", "name": "now",
                  "arguments": "{}", "status": "completed"} for k in (1, 2)]
        asked = [{"id": "msg-1", "type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "Time?"}]}]
        store.put("default", {"id": "resp-calls", "status": "completed", "output": calls}, asked)
        outs = [{"type": "function_call_output", "call_id": f"c{k}", "output": f"{k} o'clock"}
                for k in (1, 2)]
        r = await h.post_ok(R, _doc(input=outs, previous_response_id="resp-calls"))
        again = await h.post_ok(R, _doc(input=[*asked, *calls, *outs], store=False))
        assert r["usage"]["input_tokens"] == again["usage"]["input_tokens"]
        assert _text(r) == _text(again)


async def test_not_stored_unknown_deleted_and_other_tenants() -> None:
    cfg = make_config(tenants={"a": {"api_keys": ["key-a"]}, "b": {"api_keys": ["key-b"]}})
    a = {"Authorization": "Bearer key-a"}
    b = {"Authorization": "Bearer key-b"}
    async with real_app(cfg, sources=[api_source()]) as h:
        status, r1, _ = await h.post(R, _doc(input="Hi"), headers=a)
        assert status == 200
        # another tenant: not found, and cannot continue it
        assert (await _get(h, f"{R}/{r1['id']}", b))[0] == 404
        status, err, _ = await h.post(R, _doc(input="x", previous_response_id=r1["id"]), headers=b)
        assert status == 400 and err["error"]["code"] == "previous_response_not_found", err
        assert err["error"]["param"] == "previous_response_id"
        r = await h.client.delete(f"{R}/{r1['id']}", headers=b)
        assert r.status_code == 404
        assert (await _get(h, f"{R}/{r1['id']}", a))[0] == 200  # still there for its tenant
        # store: false is never kept
        status, r2, _ = await h.post(R, _doc(input="Hi", store=False), headers=a)
        assert status == 200 and r2["store"] is False
        status, err = await _get(h, f"{R}/{r2['id']}", a)
        assert status == 404 and err["error"]["param"] == "response_id", err
        status, err, _ = await h.post(R, _doc(input="x", previous_response_id=r2["id"]), headers=a)
        assert status == 400 and err["error"]["param"] == "previous_response_id", err
        # deleted: gone for reads, follow-ups and a second delete
        r = await h.client.delete(f"{R}/{r1['id']}", headers=a)
        assert r.status_code == 200
        assert msgspec.json.decode(await r.get_data()) == {"id": r1["id"], "object": "response",
                                                           "deleted": True}
        assert (await _get(h, f"{R}/{r1['id']}", a))[0] == 404
        assert (await _get(h, f"{R}/{r1['id']}/input_items", a))[0] == 404
        assert (await h.client.delete(f"{R}/{r1['id']}", headers=a)).status_code == 404
        status, err, _ = await h.post(R, _doc(input="x", previous_response_id=r1["id"]), headers=a)
        assert status == 400, err
        # no key: 401 on the stored responses' routes too
        assert (await _get(h, f"{R}/{r1['id']}"))[0] == 401
        samples = await h.metrics()
        assert samples[("calserve_responses_stored_total", (("outcome", "stored"),))] == 1.0


async def test_a_server_that_stores_nothing() -> None:
    async with real_app(make_config(server={"responses_store": False}),
                        sources=[api_source()]) as h:
        r = await h.post_ok(R, _doc(input="Hi"))
        assert r["store"] is False
        assert (await _get(h, f"{R}/{r['id']}"))[0] == 404
        status, err, _ = await h.post(R, _doc(input="x", previous_response_id=r["id"]))
        assert status == 400 and err["error"]["code"] == "unsupported_parameter", err
        assert err["error"]["param"] == "previous_response_id"


async def test_input_item_pages() -> None:
    async with real_app(make_config(), sources=[api_source()]) as h:
        items = [{"role": "user", "content": f"turn {k}"} for k in range(5)]
        r = await h.post_ok(R, _doc(input=items, max_output_tokens=1))
        base = f"{R}/{r['id']}/input_items"
        status, all_desc = await _get(h, base)  # default: newest first, 20 a page
        assert status == 200
        texts = [i["content"][0]["text"] for i in all_desc["data"]]
        assert texts == [f"turn {k}" for k in reversed(range(5))]
        ids = [i["id"] for i in all_desc["data"]]
        status, page = await _get(h, f"{base}?limit=2&order=asc")
        assert [i["id"] for i in page["data"]] == ids[::-1][:2] and page["has_more"] is True
        status, page = await _get(h, f"{base}?limit=2&order=asc&after={page['last_id']}")
        assert [i["id"] for i in page["data"]] == ids[::-1][2:4] and page["has_more"] is True
        status, page = await _get(h, f"{base}?after={ids[3]}")
        assert [i["id"] for i in page["data"]] == ids[4:] and page["has_more"] is False
        for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
                             ("order=up", "order"), ("after=nope", "after")):
            status, err = await _get(h, f"{base}?{query}")
            assert status == 400 and err["error"]["param"] == param, (query, err)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_bound_drops_the_oldest(stream: bool) -> None:
    cfg = make_config(server={"responses_max_stored": 2})
    async with real_app(cfg, sources=[api_source()]) as h:
        ids = []
        for k in range(3):
            status, raw, _ = await h.post(R, _doc(input=f"q{k}", stream=stream, max_output_tokens=2))
            assert status == 200
            ids.append((check_events(events(raw)) if stream else raw)["id"])
        assert [(await _get(h, f"{R}/{i}"))[0] for i in ids] == [404, 200, 200]



async def test_a_store_that_fails_still_answers(tmp_path: Path) -> None:
    """The store's file cannot be written (its directory is a file): the answer goes out all the
    same, streamed or not, the error is counted; what needs to read it is a 503 that says so
    (retryable), never a 500."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cfg = make_config(server={"responses_store_path": str(blocker / "responses.sqlite3")})
    async with real_app(cfg, sources=[api_source()]) as h:
        r = await h.post_ok(R, _doc(input="Hi"))
        assert r["status"] in ("completed", "incomplete") and _text(r)
        status, raw, _ = await h.post(R, _doc(input="Hi", stream=True))
        assert status == 200 and check_events(events(raw))["id"]
        m = await h.metrics()
        assert m[("calserve_responses_stored_total", (("outcome", "error"),))] == 2.0
        status, err, headers = await h.post(R, _doc(input="x", previous_response_id=r["id"]))
        assert status == 503 and err["error"]["code"] == "store_unavailable", err
        assert headers.get("retry-after") is not None
        for method in (h.client.get, h.client.delete):
            resp = await method(f"{R}/{r['id']}")
            assert resp.status_code == 503
        status, got = await _get(h, f"{R}/{r['id']}/input_items")
        assert status == 503 and got["error"]["code"] == "store_unavailable", got
