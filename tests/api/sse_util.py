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


async def stream_post(client: Any, path: str, body: Any,
                      headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST and read the body while it is produced (quart-trio's ``client.post`` buffers at most
    10 body writes before anyone reads: a longer stream would block the app)."""
    import trio

    conn = client.request(path=path, method="POST",
                          headers={"content-type": "application/json", **(headers or {})})
    raw = bytearray()
    async with conn as c:
        await c.send(msgspec.json.encode(body))
        await c.send_complete()
        while True:
            try:
                raw += await c.receive()
            except trio.EndOfChannel:
                break
    assert c.status_code is not None
    return c.status_code, bytes(raw)
