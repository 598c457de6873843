"""Top frames of a py-spy collapsed-stack profile (``py-spy record --format raw``).

``python -m bench.profile_summary PROFILE.folded [--top 25]`` prints the functions with the most
samples on-CPU by self time and by inclusive time (a function counted once per stack), as fractions
of all samples: the "where the per-token time goes" table of the http-floor profile.
``--categories`` prints the trio thread's samples by part of the serving path instead
(:data:`CATEGORIES`, the table of bench/README's host-path sections).
"""

from __future__ import annotations

import argparse
import collections
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = ["summarize", "categories", "CATEGORIES", "main"]

_LINE = re.compile(r"^(.*) (\d+)$")


def _frame(f: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)": lines merged per function
    m = re.match(r"^(.*?) \((.*?)(?::\d+)?\)$", f)
    if not m:
        return f
    path = m.group(2)
    parts = path.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{m.group(1)} ({short})"


def _stacks(path: Path, only: str | None) -> Iterator[tuple[list[str], int]]:
    """The folded file's stacks (frames, samples), those with a frame named ``only`` if given."""
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        frames = [_frame(f) for f in m.group(1).split(";") if f]
        if frames and (only is None or any(f.startswith(only + " ") for f in frames)):
            yield frames, int(m.group(2))


def summarize(path: Path, top: int = 25, only: str | None = "unrolled_run"
              ) -> dict[str, list[tuple[str, float]]]:
    """``only``: keep the stacks with a frame of that name (default: the trio thread's; py-spy
    counts threads parked in a C wait, e.g. ``SimpleQueue.get``, as active)."""
    self_: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for frames, n in _stacks(path, only):
        total += n
        self_[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    t = max(1, total)
    return {"samples": [("total", float(total))],
            "self": [(f, n / t) for f, n in self_.most_common(top)],
            "inclusive": [(f, n / t) for f, n in incl.most_common(top)]}


#: (key, what, frame prefixes): a stack counts in the first category one of whose frames it has
#: (so the send path inside the pump is "send", the actor step inside the submit is "actor").
CATEGORIES: list[tuple[str, str, tuple[str, ...]]] = [
    ("send", "the send path (hypercorn's HTTPStream.app_send and below; a body chunk's direct "
     "write, chunked_send)", ("HTTPStream.app_send ", "chunked_send.<locals>.direct ")),
    ("actor", "actor step (detokenizer, stop strings, StreamWriter.put_token)",
     ("_TokenStep.", "ActorInbox.send_nowait ", "run_actor ")),
    ("pump", "pump_stream minus the send (receive_many, encode, metrics, socket probe, pacing)",
     ("pump_stream ",)),
    ("planner", "planner pass (admission, decode batch build)", ("EngineCore._pass ",)),
    ("steps", "step bookkeeping (StepHandler.complete minus the actor step, sampling, verify)",
     ("StepHandler.complete ", "EngineCore.fast_decode ", "EngineCore.finish_fast ")),
    ("device", "device submit + completion wait (binding, completion fd)",
     ("submit_decode_wait ", "submit_prefill_wait ", "_wait_hot ", "CompletionFdWaiter",
      "DeviceExecutor.")),
    ("http", "HTTP request start and end, connection handling",
     ("TCPServer.", "_Guard.", "ASGIWrapper.", "H11Protocol.")),
]


def categories(path: Path, only: str | None = "unrolled_run") -> dict[str, float]:
    """Shares of the (trio thread's) samples per :data:`CATEGORIES` key, plus ``other``."""
    count: collections.Counter[str] = collections.Counter()
    total = 0
    for frames, n in _stacks(path, only):
        total += n
        for key, _, prefixes in CATEGORIES:
            if any(f.startswith(p) for f in frames for p in prefixes):
                count[key] += n
                break
        else:
            count["other"] += n
    t = max(1, total)
    return {k: count[k] / t for k in [c[0] for c in CATEGORIES] + ["other"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_summary", description=__doc__)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--all-threads", action="store_true",
                    help="every thread's stacks (default: the trio thread's only)")
    ap.add_argument("--categories", action="store_true",
                    help="shares per part of the serving path (bench/README's host-path table)")
    a = ap.parse_args(argv)
    if a.categories:
        what = {c[0]: c[1] for c in CATEGORIES} | {"other": "everything else"}
        for key, share in categories(a.profile, None if a.all_threads else "unrolled_run").items():
            print(f"  {share * 100:5.1f} %  {what[key]}")
        return 0
    doc = summarize(a.profile, a.top, None if a.all_threads else "unrolled_run")
    print(f"samples: {int(doc['samples'][0][1])}")
    for kind in ("self", "inclusive"):
        print(f"\n{kind}:")
        for f, share in doc[kind]:
            print(f"  {share * 100:5.1f} %  {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
