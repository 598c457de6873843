"""The engine's per-token path in instructions (callgrind): a figure the box's noise does not move.

``python -m bench.engine_instructions [--streams 64] [--tokens 64 192] [--hold-ms 1000] [--repeats 2]
[--multi-step 1] [--json]``

:mod:`bench.engine_path` times the per-token path in CPU µs, which on a shared 2-vCPU box moves by
10–40 % from one minute to the next (bench/README): a change worth a few percent cannot be seen in
one run. This runs it under ``valgrind --tool=callgrind`` at two token counts and prints
``(Ir(N2) - Ir(N1)) / ((N2 - N1) * streams)``: the instructions one more token costs, with the
start-up (imports, the model load, the first jobs) cancelling out of the difference.

The hold: under valgrind the process runs ~50x slower while the pump's hold is wall-clock time, so
the default 1000 ms hold gives reads of about as many tokens as ``engine_path --hold-ms 20`` does
natively (16–19 tokens a read against ~11). The per-read work is shared by a read's tokens, so the
figure depends on that count: the longer run's tokens a read are printed beside it, and two
figures compare only at similar counts. ``--hold-ms 0`` wakes every stream for every token (no
grouping: a trio task switch a token, far more instructions).

Needs valgrind (``apt-get install valgrind``); a pair of runs takes ~1.5 min on a 2-vCPU box.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["parse_collected", "parse_tokens_a_read", "instructions_per_token", "measure", "main"]

_COLLECTED = re.compile(r"Collected\s*:\s*([\d,]+)")
_PER_READ = re.compile(r"([\d.]+) tokens a read")

#: One run of the benchmark at ``tokens`` tokens a stream: (instructions, tokens a read or None).
Runner = Callable[[int], tuple[int, float | None]]


def parse_collected(text: str) -> int:
    """The instruction count callgrind printed (``==PID== Collected : N``)."""
    m = _COLLECTED.search(text)
    if m is None:
        raise ValueError("no 'Collected :' line in callgrind's output (did valgrind run?)")
    return int(m.group(1).replace(",", ""))


def parse_tokens_a_read(text: str) -> float | None:
    """The tokens a read ``bench.engine_path`` printed (None without a hold)."""
    m = _PER_READ.search(text)
    return float(m.group(1)) if m else None


def instructions_per_token(ir1: int, ir2: int, n1: int, n2: int, streams: int) -> float:
    """Instructions of one more token: the two runs' difference over the tokens between them."""
    if n2 <= n1 or streams <= 0:
        raise ValueError(f"need n2 > n1 and streams > 0 (got n1={n1}, n2={n2}, streams={streams})")
    return (ir2 - ir1) / ((n2 - n1) * streams)


def measure(run: Runner, n1: int, n2: int, streams: int, repeats: int = 1) -> list[dict[str, Any]]:
    """``repeats`` pairs of runs (``n1`` then ``n2`` tokens a stream), each pair's figure."""
    out = []
    for _ in range(max(1, repeats)):
        ir1, _ = run(n1)
        ir2, per_read = run(n2)
        out.append({"instructions_per_token": instructions_per_token(ir1, ir2, n1, n2, streams),
                    "tokens_per_read": per_read, "instructions": [ir1, ir2]})
    return out


def valgrind_runner(streams: int, hold_ms: float, multi_step: int = 1,
                    valgrind: str = "valgrind") -> Runner:
    """A :data:`Runner` that runs ``bench.engine_path`` under callgrind in a subprocess."""

    def run(tokens: int) -> tuple[int, float | None]:
        argv = [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-m",
                "bench.engine_path", "--streams", str(streams), "--tokens", str(tokens), "--reps", "1",
                "--hold-ms", f"{hold_ms:g}", "--multi-step", str(multi_step)]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        text = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"engine_path under callgrind exited {proc.returncode}: {text[-500:]}")
        return parse_collected(text), parse_tokens_a_read(text)

    return run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_instructions", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, nargs=2, default=[64, 192], metavar=("N1", "N2"),
                    help="the two token counts a stream (default 64 192)")
    ap.add_argument("--hold-ms", type=float, default=1000.0,
                    help="the pump's hold after a read, wall clock (default 1000: ~50x engine_path's "
                         "20, as valgrind runs ~50x slower)")
    ap.add_argument("--repeats", type=int, default=2, help="pairs of runs (default 2)")
    ap.add_argument("--multi-step", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    a = ap.parse_args(argv)
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("engine_instructions: valgrind not found (apt-get install valgrind)", file=sys.stderr)
        return 2
    n1, n2 = a.tokens
    rows = measure(valgrind_runner(a.streams, a.hold_ms, a.multi_step, valgrind), n1, n2, a.streams,
                   a.repeats)
    if a.json:
        print(json.dumps({"streams": a.streams, "tokens": [n1, n2], "hold_ms": a.hold_ms,
                          "multi_step": a.multi_step, "pairs": rows}, indent=1))
        return 0
    for r in rows:
        per_read = r["tokens_per_read"]
        held = f", {per_read:.1f} tokens a read" if per_read is not None else ", no hold"
        print(f"engine_instructions: {r['instructions_per_token']:,.0f} instructions a token "
              f"({a.streams} streams, {n1} -> {n2} tokens{held})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
