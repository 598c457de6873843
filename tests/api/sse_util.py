from __future__ import annotations

from typing import Any

import msgspec


def parse_sse(raw: bytes) -> list[Any]:
    """Split an SSE body into decoded JSON payloads; ``[DONE]`` stays the string "[DONE]"."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else msgspec.json.decode(payload))
    return out


async def send_and_read(conn: Any, body: bytes) -> tuple[Any, bytes]:
    """Open ``conn`` (a quart test-client ``client.request(...)``), send ``body`` and read the
    response body while it is produced (quart-trio's ``client.post`` buffers at most 10 body writes
    before anyone reads: a longer stream would block the app). Returns the finished connection
    (``status_code``, ``headers``) and the body."""
    import trio

    raw = bytearray()
    async with conn as c:
        await c.send(body)
        await c.send_complete()
        while True:
            try:
                raw += await c.receive()
            except trio.EndOfChannel:
                break
    return c, bytes(raw)


async def stream_post(client: Any, path: str, body: Any,
                      headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST ``body`` as JSON and read the response while it is produced (:func:`send_and_read`)."""
    conn = client.request(path=path, method="POST",
                          headers={"content-type": "application/json", **(headers or {})})
    c, raw = await send_and_read(conn, msgspec.json.encode(body))
    assert c.status_code is not None
    return c.status_code, raw
