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
