"""A digest of greedy outputs, to show a change of the per-token path changed no output.

``python -m bench.greedy_digest [--requests 24] [--tokens 48]``

The real engine over the software runtime with real compute (the demo package, sim-next B1..B16
with PING/PONG, timing ``none``), ``--requests`` greedy requests with distinct prompts submitted at
once (so they share decode batches, PING/PONG and the fast paths), each ``--tokens`` tokens with
``ignore_eos``; prints the sha256 of the token ids in request order. Run it on the trees before and
after a change: the same digest means the same tokens for every request.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import trio

__all__ = ["main", "digest"]


async def _run(requests: int, tokens: int) -> list[list[int]]:
    from bench.scenario_lib import calserve_config
    from calserve.config import decode_config
    from calserve.engine.engine import Engine
    from calserve.engine.types import GenerateRequest, SamplingParams, TokenEvent

    cfg = decode_config(calserve_config(profiles=[1, 4, 8, 16], timing="none"))
    outs: list[list[int]] = [[] for _ in range(requests)]
    async with Engine.open(cfg) as eng:

        async def one(i: int) -> None:
            prompt = tuple(100 + (i * 7 + k * 13) % 400 for k in range(4 + i % 9))
            h = await eng.submit(GenerateRequest(prompt, SamplingParams(
                max_tokens=tokens, ignore_eos=True, temperature=0.0)))
            async for ev in h.events():
                if isinstance(ev, TokenEvent):
                    outs[i].extend(ev.token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(requests):
                nursery.start_soon(one, i)
    return outs


def digest(outs: list[list[int]]) -> str:
    h = hashlib.sha256()
    for toks in outs:
        h.update((",".join(map(str, toks)) + ";").encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.greedy_digest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args(argv)
    from bench.server import BENCH_OUT

    os.environ.setdefault("CALSERVE_HOME", str(BENCH_OUT / ".home"))
    outs = trio.run(_run, a.requests, a.tokens)
    n = sum(len(t) for t in outs)
    print(f"greedy digest {digest(outs)} ({a.requests} requests, {n} tokens)")
    return 0 if n == a.requests * a.tokens else 1


if __name__ == "__main__":
    raise SystemExit(main())
