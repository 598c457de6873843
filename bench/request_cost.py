"""Server CPU a request for short streamed requests: calserve against the floor of its HTTP stack.

``python -m bench.request_cost [--output 1] [--duration 4] [--multi-step 0] [--out DIR]``

``http-floor`` divides the server's CPU by the tokens of 256-token streams, where what a request
costs at its start and end is spread over its tokens. Here the streams are short (``--output``
tokens, default 1: the one token comes from the prefill), so the figure is what a request costs
beyond its tokens: the HTTP request and response (the floor's share too), decoding and checking
the body, admission, the request's actor and stream, its prefill job, the handler's tasks and
their tear-down, the metrics of its start and end.

Same server configuration and load as ``http-floor`` (:func:`bench.http_floor.server_config`: null
compute, timing ``none``; 64 concurrent streams, 16-token prompts, ``ignore_eos``); the floor is
:mod:`bench.floor_app` under the same hypercorn trio worker sending as many events a request, of
calserve's event size. Server CPU is ``/proc/PID/stat``'s over the load window (the software
runtime's engine threads included: with null compute they still take every job) divided by the
requests that completed. Prints both, the ratio, and the requests a second; writes
``DIR/summary.json``. One run on one box: alternate two trees run by run to compare them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.http_floor import CONCURRENCY, measure, probe_event_size, server_config, with_batch
from bench.scenario_lib import write_json
from bench.server import BENCH_OUT, Server

__all__ = ["run", "main"]


def run(out: Path, output: int = 1, duration: float = 4.0, multi_step: int = 0,
        warmup: float = 1.0) -> dict[str, Any]:
    cfg = server_config()
    if multi_step > 1:
        cfg = with_batch(cfg, {"multi_step": multi_step})
    with Server.calserve(cfg, out / "server-calserve") as srv:
        cal = measure(srv, out / "calserve", duration, output, warmup, progress=False)
        size = max(64, probe_event_size(srv.url))
    argv = [sys.executable, "-m", "bench.floor_app", "--port", "{port}", "--chunk-bytes", str(size)]
    with Server.start(argv, out / "server-floor", ready_path="/health") as fsrv:
        flo = measure(fsrv, out / "floor", duration, output, warmup, progress=False)
    doc = {"scenario": "request-cost", "concurrency": CONCURRENCY, "output_tokens": output,
           "multi_step": multi_step, "event_bytes": size, "calserve": cal, "floor": flo,
           "ratio_per_request": cal["us_per_request"] / max(1e-9, flo["us_per_request"]),
           "us_per_request_beyond_floor": cal["us_per_request"] - flo["us_per_request"]}
    write_json(out / "summary.json", doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.request_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", type=int, default=1, help="tokens a request streams (default 1)")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds of load a side")
    ap.add_argument("--multi-step", type=int, default=0, help="scheduler.batch.multi_step (0: off)")
    ap.add_argument("--warmup", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=BENCH_OUT / "request_cost")
    a = ap.parse_args(argv)
    if a.output < 1 or a.duration <= 0:
        ap.error("--output must be >= 1 and --duration > 0")
    doc = run(a.out, a.output, a.duration, a.multi_step, a.warmup)
    cal, flo = doc["calserve"], doc["floor"]
    print(f"request-cost: {a.output} token(s) a request, {CONCURRENCY} streams, "
          f"events of {doc['event_bytes']} B")
    for name, side in (("calserve", cal), ("floor", flo)):
        print(f"  {name:8s} {side['us_per_request']:8.1f} µs of server CPU a request "
              f"({side['requests_per_s']:.0f} requests/s, {side['requests']} completed, "
              f"{side['events_per_request']:.2f} events a request)")
    print(f"  calserve / floor: {doc['ratio_per_request']:.2f}x "
          f"({doc['us_per_request_beyond_floor']:.0f} µs a request beyond the floor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
