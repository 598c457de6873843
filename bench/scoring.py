"""Scoring prompts against answering them: what an evaluation harness's loglikelihood calls cost.

``python -m bench.scoring [--package DIR] [--alias NAME] [--prompt 96] [--requests 64]
[--concurrency 16] [--quick] [--out DIR]``

calserve on the software runtime (timing ``none``, profiles B1..B16 with PING/PONG, as
``configs/sim-next.yaml``), the built-in demo package or ``--package`` (e.g. SmolLM2's). The same
token-id prompts of ``--prompt`` tokens, closed loop at ``--concurrency``, two ways, alternated
twice:

- ``score``: ``echo``, ``logprobs: 1``, ``max_tokens: 0`` (lm-evaluation-harness's
  ``local-completions`` loglikelihood call): every prompt token's logprob — from the prefill
  (the software runtime's ``prompt_logits`` capability: every position's logits in one job), and
  on a second server with ``scheduler.batch.prompt_logits_max_bytes: 0`` by teacher forcing (a
  decode step per prompt token, batched with the others: what a runtime that returns the last
  position's logits only allows), ``score_teacher``;
- ``answer``: ``max_tokens: 1``: one prefill per prompt (what the prompt costs unscored).

The two servers alternate twice (each runs score and answer). Prints and writes
(``summary.json``) prompt tokens per second of each way, the ratios to ``answer`` on the same
server, and each request's latency p50/p99.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench.httpclient import ConnectionPool
from bench.scenario_lib import calserve_config
from bench.server import BENCH_OUT, Server, pin_self

__all__ = ["run", "main"]


async def _load(port: int, docs: list[dict[str, Any]], concurrency: int) -> tuple[float, list[float]]:
    """POST every doc to /v1/completions, ``concurrency`` at a time; (seconds, latencies)."""
    pool = ConnectionPool("127.0.0.1", port)
    todo = list(docs)
    lat: list[float] = []

    async def worker() -> None:
        while todo:
            body = json.dumps(todo.pop()).encode()
            t0 = time.perf_counter()
            resp = await pool.request("POST", "/v1/completions", body,
                                      {"content-type": "application/json"})
            raw = await resp.read_all()
            await pool.release(resp.conn)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {raw[:300]!r}")
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for _ in range(concurrency):
            n.start_soon(worker)
    took = time.perf_counter() - t0
    await pool.aclose()
    return took, lat


_WORDS = ("the of and to in is was for on that with as by at from his her they this which be or an"
          " are not have one had were but all their there been has when who will more no if out so"
          " said what up its about into than them can only other new some could time these two may"
          " then do first any my now such like our over man me even most made after also did many"
          " before must through back years where much your way well down should because each just"
          " those people how too little state good very make world still own see men work long").split()


def _tokens(port: int, alias: str, rng: random.Random, n: int) -> list[int]:
    """``n`` token ids of random English words, as the server's tokenizer gives them."""
    text = " ".join(rng.choice(_WORDS) for _ in range(2 * n))
    body = json.dumps({"model": alias, "prompt": text}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/tokenize", body, {"content-type": "application/json"})
    ids = json.loads(conn.getresponse().read())["tokens"]
    conn.close()
    return [int(t) for t in ids[:n]]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(out: Path | None, quick: bool, *, package: str | None = None, alias: str = "qwen3",
        prompt: int = 96, requests: int = 64, concurrency: int = 16) -> dict[str, Any]:
    if quick:
        requests, prompt = min(requests, 32), min(prompt, 64)
    out = out or BENCH_OUT / "scoring"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    pin_self(1)
    score = {"echo": True, "logprobs": 1, "max_tokens": 0}
    servers = {"prefill": {"score": score, "answer": {"max_tokens": 1}},
               "teacher": {"score_teacher": score, "answer_teacher": {"max_tokens": 1}}}
    res: dict[str, list[tuple[float, list[float]]]] = {
        w: [] for ways in servers.values() for w in ways}
    prompts: list[list[int]] = []
    for _ in range(2):
        for name, ways in servers.items():
            cfg = calserve_config(profiles=[1, 4, 8, 16], timing="none")
            cfg["models"] = {alias: {"package": package, "timing": "none"}}
            if name == "teacher":
                cfg.setdefault("scheduler", {}).setdefault("batch", {})[
                    "prompt_logits_max_bytes"] = 0
            with Server.calserve(cfg, out / f"server-{name}") as srv:
                if not prompts:
                    prompts = [_tokens(srv.port, alias, rng, prompt) for _ in range(requests)]
                trio.run(_load, srv.port, [{"model": alias, "prompt": p, "max_tokens": 1}
                                           for p in prompts[:4]], 4)  # warm-up
                for way, extra in ways.items():
                    docs = [{"model": alias, "prompt": p, "temperature": 0, **extra}
                            for p in prompts]
                    res[way].append(trio.run(_load, srv.port, docs, concurrency))
    summary: dict[str, Any] = {"package": package or "demo", "prompt_tokens": prompt,
                               "requests": requests, "concurrency": concurrency}
    for way, runs in res.items():
        rates = [requests * prompt / took for took, _ in runs]
        lat = [x for _, ls in runs for x in ls]
        summary[way] = {"prompt_tokens_per_s": [round(r, 1) for r in rates],
                        "latency_p50_s": round(_pct(lat, 0.5), 4),
                        "latency_p99_s": round(_pct(lat, 0.99), 4)}

    def ratio(a: str, b: str) -> float:
        return round(float(statistics.median(summary[a]["prompt_tokens_per_s"]))
                     / float(statistics.median(summary[b]["prompt_tokens_per_s"])), 3)

    summary["score_over_answer"] = ratio("score", "answer")
    summary["score_teacher_over_answer"] = ratio("score_teacher", "answer_teacher")
    summary["score_over_score_teacher"] = ratio("score", "score_teacher")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for way in res:
        s = summary[way]
        print(f"{way:14}: {s['prompt_tokens_per_s']} prompt tokens/s, latency p50"
              f" {s['latency_p50_s'] * 1000:.0f} ms, p99 {s['latency_p99_s'] * 1000:.0f} ms")
    print(f"scored / answered prompt tokens per second: from the prefill"
          f" {summary['score_over_answer']}, by teacher forcing"
          f" {summary['score_teacher_over_answer']}; prefill / teacher forcing"
          f" {summary['score_over_score_teacher']}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", help="a package directory (default: the built-in demo)")
    ap.add_argument("--alias", default="qwen3")
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    run(a.out, a.quick, package=a.package, alias=a.alias, prompt=a.prompt, requests=a.requests,
        concurrency=a.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
