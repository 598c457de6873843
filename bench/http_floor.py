"""Per-token server CPU of calserve vs the floor of its HTTP stack, side by side in one run.

``python -m bench.http_floor [--quick]`` (also ``python -m bench.scenarios http-floor``):

1. calserve (``runtime.null_compute: true``, timing ``none``: the device costs nothing, so what is left
   is the serving layer) under hypercorn's trio worker, 64 concurrent streams, pinned to core 0;
2. the bare ASGI app of :mod:`bench.floor_app` under the same hypercorn trio worker, streaming
   pre-encoded chunks of the same size as calserve's events had under this load (one ``send`` per
   event), same load.

calserve runs twice: with its defaults (the serving thread is saturated here, so streams group the
tokens produced within ``server.stream_busy_interval_ms`` into one event: calserve/api/pacing.py)
and with grouping off (``stream_busy_interval_ms: 0``: one event per token); each is compared with
the floor at its own event size, and (issue 18) with a floor that also groups the same number of
tokens into each event as calserve did (``ratio_per_token_same_grouping``, target <= 2x): what calserve
costs per token beyond what the stack itself costs for the same events. That floor runs flat out (its
clients always busy reading, its loop never asleep); a third one sends the same events at calserve's
own event rate (``floor_app --events-per-s``, ``ratio_per_token_same_grouping_same_rate``), where each
event finds its client waiting to be woken as calserve's do: the stack's cost per event at that pace.

Those runs saturate calserve (the device costs nothing, so it makes tokens as fast as its thread
can), and then its CPU per event is its share of a stream's event period, whatever a token costs
(:func:`period_ratio`). One more run puts it on a timed device (``calserve_device_paced``: a
:data:`PACED_STEP_US` B16 step, an event every :data:`PACED_INTERVAL_MS` a stream), where its thread
is idle part of the time and its CPU per token is what its events and tokens cost; against the
floor at the same events and rate that is ``ratio_per_token_device_paced``.

Server CPU comes from ``/proc/PID/stat`` (utime + stime of the serving process) over the load window;
divided by the content events the client received it gives CPU µs per streamed event (and per token,
when the server coalesces several tokens into one event). The ratio calserve / floor is the figure
(target <= 1.25x). A profile of calserve under the same load is saved next to it when py-spy or
pyinstrument is available (``pip install pyinstrument``; neither is a dependency).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench import procstat
from bench.httpclient import ConnectionPool, iter_sse
from bench.scenario_lib import calserve_config, run_point, write_json
from bench.server import BENCH_OUT, Server, pin_self

__all__ = ["run", "main", "measure", "probe_event_size", "floor_point", "server_config",
           "with_batch", "period_ratio", "device_paced_config", "PACED_STEP_US", "PACED_INTERVAL_MS",
           "HOST_VARIANT"]

CONCURRENCY = 64


async def _probe(url: str) -> float:
    host, port = url.removeprefix("http://").split(":")
    pool = ConnectionPool(host, int(port))
    body = json.dumps({"prompt": [300, 301, 302], "max_tokens": 16, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    resp = await pool.request("POST", "/v1/completions", body,
                              {"Content-Type": "application/json"})
    sizes = [len(d) + 8 for _, d in [e async for e in iter_sse(resp)] if d != b"[DONE]"]
    await resp.conn.aclose()
    return sum(sizes[:-1]) / max(1, len(sizes) - 1)  # content events (last one is the finish)


def probe_event_size(url: str) -> int:
    """Mean bytes of one streamed content event (``data: {...}\\n\\n``) of the server at ``url``."""
    return round(trio.run(_probe, url))


def measure(srv: Server, out: Path, dur: float, output: int = 256, warmup: float = 1.0,
            progress: bool = True) -> dict[str, Any]:
    """The server's CPU over ``dur`` s of the scenario's load (64 streams of ``output`` tokens,
    after ``warmup`` s of it): per event, per token, per completed request (``bench.request_cost``
    reads the last), the software runtime's device threads apart."""
    run_point(srv, out.with_name(out.name + "-warmup"), concurrency=CONCURRENCY, duration=warmup,
              prompt="16", output=str(output), progress=False, scrape_interval_s=None)
    before = procstat.sample(srv.pid)
    dev0 = procstat.threads_cpu_s(srv.pid, procstat.SIM_DEVICE_THREADS)
    t0 = time.monotonic()
    res = run_point(srv, out, concurrency=CONCURRENCY, duration=dur, prompt="16",
                    output=str(output), scrape_interval_s=None, progress=progress)
    after = procstat.sample(srv.pid)
    dev1 = procstat.threads_cpu_s(srv.pid, procstat.SIM_DEVICE_THREADS)
    wall = time.monotonic() - t0
    assert before and after, "server process vanished"
    events = sum(len(r.token_times) for r in res.records)
    tokens = sum(r.output_tokens if r.outcome == "ok" else len(r.token_times) for r in res.records)
    content_bytes = sum(r.content_bytes for r in res.records)
    ok = [r for r in res.records if r.outcome == "ok"]
    cpu = after.cpu_s - before.cpu_s
    # The software CalRT's engine threads are the simulated NPU (null compute still allocates,
    # completes and checksums every job): a real device would not take that from the host, so it is
    # also reported apart (0 for the floor app, which has no device).
    dev = dev1 - dev0
    return {"cpu_s": cpu, "wall_s": wall, "cpu_util": cpu / wall, "events": events,
            "tokens": tokens, "us_per_event": cpu / max(1, events) * 1e6,
            "us_per_token": cpu / max(1, tokens) * 1e6,
            "device_threads_cpu_s": dev,
            "us_per_token_host_only": (cpu - dev) / max(1, tokens) * 1e6,
            "events_per_s": events / wall, "tokens_per_event": tokens / max(1, events),
            "event_bytes": content_bytes / max(1, events), "outcomes": res.summary["outcomes"],
            "requests": len(ok), "us_per_request": cpu / max(1, len(ok)) * 1e6,
            "requests_per_s": len(ok) / wall,
            "events_per_request": sum(len(r.token_times) for r in ok) / max(1, len(ok))}


def _tool(name: str) -> str | None:
    """``name`` on PATH, else beside this interpreter (a virtualenv's ``bin/`` that is not on PATH:
    ``pip install py-spy`` into the venv, then ``.venv/bin/python -m bench.http_floor``)."""
    found = shutil.which(name)
    if found:
        return found
    here = Path(sys.executable).parent / name
    return str(here) if here.is_file() and os.access(here, os.X_OK) else None


def _profile(cfg: dict[str, Any], out: Path, dur: float, stem: str = "calserve_profile") -> str | None:
    """Save a profile of calserve under the same load (py-spy attach, else pyinstrument), as
    ``out/<stem>.*`` (py-spy: its shares per part of the serving path beside it,
    ``<stem>_categories.json``)."""
    pyspy = _tool("py-spy")
    if pyspy:
        with Server.calserve(cfg, out / f"server-{stem}") as srv:
            # collapsed stacks (flamegraph.pl / speedscope read them) + a top-frames summary
            target = out / f"{stem}.folded"
            spy = subprocess.Popen([pyspy, "record", "--format", "raw", "--rate", "200", "-o",
                                    str(target), "--pid", str(srv.pid), "--duration",
                                    str(int(dur))], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT)
            run_point(srv, out / f"{stem}-profiled", concurrency=CONCURRENCY, duration=dur, prompt="16",
                      output="256", scrape_interval_s=None, progress=False)
            spy.wait(30)
        if not target.exists():
            return None
        from bench.profile_summary import categories, summarize
        write_json(out / f"{stem}_top.json", summarize(target, 40))
        write_json(out / f"{stem}_categories.json", categories(target))
        return str(target)
    try:
        import pyinstrument  # noqa: F401
    except ImportError:
        return None
    session = out / f"{stem}.pyisession"
    target = out / f"{stem}.html"
    cfg_dir = out / f"server-{stem}"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    import yaml

    from bench.server import free_port
    port = free_port()
    cfg = {**cfg, "server": {"host": "127.0.0.1", "port": port}}
    (cfg_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "pyinstrument", "-r", "pyisession", "-o", str(session), "-m", "bench.serve_entry", "--config", str(cfg_dir / "config.yaml"),
            "--port", "{port}"]
    with Server.start(argv, cfg_dir, port=port) as srv:
        run_point(srv, out / f"{stem}-profiled", concurrency=CONCURRENCY, duration=dur, prompt="16",
                  output="256", scrape_interval_s=None, progress=False)
    if not session.exists():
        return None
    for renderer, path in (("html", target), ("text", out / f"{stem}.txt")):
        subprocess.run([sys.executable, "-m", "pyinstrument", "--load", str(session), "-r",
                        renderer, "-o", str(path)], check=False, timeout=120)
    return str(target) if target.exists() else None


def period_ratio(cal: dict[str, Any], floor_us_per_event: float, streams: int = CONCURRENCY
                 ) -> dict[str, float]:
    """What decides the grouped ratio when calserve's thread is saturated (as it is here: null
    compute, the device costs nothing). Its CPU per event is then its CPU share of the time between
    one stream's events divided by the streams (``cpu_util * period / streams``, the period being
    the hold of ``server.stream_busy_interval_ms`` plus the queueing after it), whatever the engine
    costs a token: a cheaper engine gets more tokens into each event, and the floor at that
    grouping gets as much cheaper a token. So the ratio to a floor sending the same events is
    ``cpu_util * period / (streams * floor_us_per_event)``: ``ratio_from_period`` (it matches the
    measured ratio up to rounding; session 44, bench/README). The engine's own cost a token shows in
    the tokens an event and in ``bench.engine_path``, not in this ratio."""
    eps = cal["events_per_s"]
    period_s = streams / eps if eps else math.inf
    return {"stream_period_ms": period_s * 1e3,
            "ratio_from_period": cal["cpu_util"] * period_s / streams * 1e6 / floor_us_per_event}


def _tag(size: int, tokens_per_event: float = 1.0, events_per_s: float = 0.0) -> str:
    return (f"{size}" + ("" if tokens_per_event == 1.0 else f"-tpe{tokens_per_event}")
            + (f"-at{events_per_s:.0f}" if events_per_s else ""))


def _floor(out: Path, size: int, dur: float, tokens_per_event: float = 1.0,
           events_per_s: float = 0.0) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.floor_app", "--port", "{port}", "--chunk-bytes", str(size),
            "--tokens-per-event", str(tokens_per_event)]
    if events_per_s:
        argv += ["--events-per-s", str(events_per_s)]
    tag = _tag(size, tokens_per_event, events_per_s)
    with Server.start(argv, out / f"server-floor-{tag}", ready_path="/health") as fsrv:
        res = measure(fsrv, out / f"floor-{tag}", dur)
        res["probe_event_bytes"] = probe_event_size(fsrv.url)
    return res


def floor_point(out: Path, size: int, dur: float, tokens_per_event: float = 1.0) -> dict[str, Any]:
    """The box's floor: the bare ASGI app under the same hypercorn trio worker and load, CPU per
    streamed event of ``size`` bytes (``us_per_event``), for scenarios that report it beside
    their figures (the knee)."""
    return _floor(out, size, dur, tokens_per_event)


def server_config() -> dict[str, Any]:
    """calserve's configuration in this scenario (``bench.engine_path`` runs its engine with it):
    null compute, timing ``none``, profiles B1..B16 with PING/PONG, and every one of the 64 streams
    streaming (a 429 costs CPU but streams no token): no expected-wait refusal, no running cap
    (so no time-slicing either), where this calserve has those admission extensions."""
    cfg = calserve_config(profiles=[1, 4, 8, 16], timing="none", null_compute=True)
    from calserve.config import AdmissionConfig
    fields = set(AdmissionConfig.__struct_fields__)
    adm = {k: None for k in ("max_expected_wait_ms", "max_tpot_steps") if k in fields}
    if adm:
        cfg["scheduler"]["admission"] = adm
    return cfg


def with_batch(cfg: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``scheduler.batch`` updated by ``batch`` (a copy)."""
    sched = dict(cfg["scheduler"])
    sched["batch"] = {**sched["batch"], **batch}
    return {**cfg, "scheduler": sched}


#: The device-paced variant: a timed device whose B16 step takes this long (``bench-step-N``
#: timing, null compute) and events every PACED_INTERVAL_MS per stream, so calserve is *not*
#: saturated (session 44: ~0.5 of its core, ~9 tokens an event, ~7,400 tokens/s).
PACED_STEP_US = 2000
PACED_INTERVAL_MS = 72
#: The device-paced multi-step variant with the jobs driven by the host (runtime.host_multi_step).
HOST_VARIANT = "calserve_device_paced_host_multi_step"


def device_paced_config(cfg: dict[str, Any], step_us: int = PACED_STEP_US) -> dict[str, Any]:
    """``cfg`` (:func:`server_config`) on a device that paces it: the demo model's timing replaced
    by ``bench-step-<step_us>`` (a copy; still null compute: the step is a wait, not host work)."""
    from bench.serve_entry import STEP_PREFIX
    models = {name: {**m, "timing": f"{STEP_PREFIX}{step_us}"} for name, m in cfg["models"].items()}
    return {**cfg, "models": models}


def variant_configs(cfg: dict[str, Any], stream_interval_ms: int = 0, multi_step: int = 8,
                    device_paced: bool = True
                    ) -> dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """:func:`run`'s calserve variants of ``cfg`` (:func:`server_config`), in the order they run:
    name -> (its ``server`` section overrides, its ``scheduler.batch`` overrides, its whole
    configuration). ``multi_step`` > 1 adds the multi-step variants (grouped and not, and on the
    timed device where ``device_paced``) where this calserve has ``scheduler.batch.multi_step``, and
    on the timed device the same jobs driven by the host (``runtime.host_multi_step``: the device
    runs one step a job) where it has that."""
    from calserve.config import BatchConfig, RuntimeConfig, ServerConfig
    servers: dict[str, dict[str, Any]] = {"calserve": {}}
    batches: dict[str, dict[str, Any]] = {}
    grouping = "stream_busy_interval_ms" in ServerConfig.__struct_fields__
    stepping = multi_step > 1 and "multi_step" in BatchConfig.__struct_fields__
    if grouping:
        servers["calserve_ungrouped"] = {"stream_busy_interval_ms": 0}
    if stepping:
        servers["calserve_multi_step"] = {}
        batches["calserve_multi_step"] = {"multi_step": multi_step}
        if grouping:
            servers["calserve_multi_step_ungrouped"] = servers["calserve_ungrouped"]
            batches["calserve_multi_step_ungrouped"] = {"multi_step": multi_step}
    if stream_interval_ms:  # what-if: a fixed interval
        servers[f"calserve_interval_{stream_interval_ms}ms"] = {"stream_interval_ms": stream_interval_ms}
    paced = device_paced and "stream_interval_ms" in ServerConfig.__struct_fields__
    if paced:
        servers["calserve_device_paced"] = {"stream_interval_ms": PACED_INTERVAL_MS}
    if paced and stepping:  # the host's cost a token with one job a multi_step tokens a lane
        servers["calserve_device_paced_multi_step"] = {"stream_interval_ms": PACED_INTERVAL_MS}
        batches["calserve_device_paced_multi_step"] = {"multi_step": multi_step}
    hosted = paced and stepping and "host_multi_step" in RuntimeConfig.__struct_fields__
    if hosted:  # the same, the device running one step a job and the binding feeding tokens back
        servers[HOST_VARIANT] = {"stream_interval_ms": PACED_INTERVAL_MS}
        batches[HOST_VARIANT] = {"multi_step": multi_step}
    out: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}
    for name, server in servers.items():
        vcfg = {**cfg, "server": server} if server else cfg
        if name.startswith("calserve_device_paced"):
            vcfg = device_paced_config(vcfg)
        if name in batches:
            vcfg = with_batch(vcfg, batches[name])
        if name == HOST_VARIANT:
            vcfg = {**vcfg, "runtime": {**vcfg["runtime"], "host_multi_step": True}}
        out[name] = (server, batches.get(name, {}), vcfg)
    return out


def run(out: Path, quick: bool, stream_interval_ms: int = 0, multi_step: int = 8,
        device_paced: bool = True) -> dict[str, Any]:
    """calserve with its defaults (adaptive grouping: several tokens per event while the serving
    thread is saturated, which it is here) and with grouping off (one event per token), each against
    the floor streaming events of the size calserve's had under this load; then both again with
    ``scheduler.batch.multi_step`` (this load is greedy: up to that many device steps a decode
    job, the runtime's multi_step capability) where this calserve has it (0: not run).

    ``device_paced``: also calserve on a timed device (:data:`PACED_STEP_US`, events every
    :data:`PACED_INTERVAL_MS`), which leaves its thread idle part of the time. Saturated (the
    variants above), calserve's CPU per event is pinned to the stream period's share whatever a
    token costs (:func:`period_ratio`); below saturation it is what its events and tokens cost,
    and its ratio to the floor sending the same events at the same rate
    (``ratio_per_token_device_paced``) moves with the host's cost per token. With ``multi_step``
    too, that again with multi-step jobs (``ratio_per_token_device_paced_multi_step``: the device
    paces the same tokens a second, each job ``multi_step`` of its steps, so the host's work a job
    is spread over that many tokens a lane)."""
    dur = 4.0 if quick else 8.0
    cfg = server_config()
    configs = variant_configs(cfg, stream_interval_ms, multi_step, device_paced)
    doc: dict[str, Any] = {"concurrency": CONCURRENCY, "variants": {}}
    floors: dict[tuple[int, float, float], dict[str, Any]] = {}
    for name, (server, batch, vcfg) in configs.items():
        with Server.calserve(vcfg, out / f"server-{name}") as srv:
            cal = measure(srv, out / name, dur)
        size = max(64, round(cal["event_bytes"]))
        # Three floors: one token per event (the floor of the per-token target); the same tokens
        # per event as calserve's streams had (issue 18: host work per token at the same grouping;
        # for the ungrouped run the two are the same), flat out; and that again at calserve's own
        # event rate (floor_app --events-per-s): run flat out, the floor's clients are always busy
        # reading and its loop never sleeps, while calserve's events arrive at a fraction of that
        # rate, each finding its client (and, below saturation, the server) waiting to be woken.
        tpe = max(1.0, round(cal["tokens_per_event"], 1))
        rate = float(round(cal["events_per_s"]))
        for key in {(size, 1.0, 0.0), (size, tpe, 0.0), (size, tpe, rate)}:
            if key not in floors:
                floors[key] = _floor(out, key[0], dur, key[1], key[2])
        flo, same, paced = floors[(size, 1.0, 0.0)], floors[(size, tpe, 0.0)], floors[(size, tpe, rate)]
        doc["variants"][name] = {
            "server": server, "batch": batch, "calserve": cal, "floor_event_bytes": size,
            "floor_us_per_event": flo["us_per_event"],
            "ratio_per_event": cal["us_per_event"] / flo["us_per_event"],
            "ratio_per_token": cal["us_per_token"] / flo["us_per_token"],
            "ratio_per_token_host_only": cal["us_per_token_host_only"] / flo["us_per_token"],
            # at the same grouping: the floor sends events of calserve's size and tokens/event
            "floor_same_grouping": {"tokens_per_event": same["tokens_per_event"],
                                    "us_per_event": same["us_per_event"],
                                    "us_per_token": same["us_per_token"]},
            "ratio_per_token_same_grouping": cal["us_per_token"] / same["us_per_token"],
            "ratio_per_token_host_only_same_grouping":
                cal["us_per_token_host_only"] / same["us_per_token"],
            "host_us_per_token_beyond_floor": cal["us_per_token_host_only"] - same["us_per_token"],
            "floor_same_grouping_same_rate": {"tokens_per_event": paced["tokens_per_event"],
                                              "events_per_s": paced["events_per_s"],
                                              "us_per_event": paced["us_per_event"],
                                              "us_per_token": paced["us_per_token"]},
            "ratio_per_token_same_grouping_same_rate": cal["us_per_token"] / paced["us_per_token"],
            "saturated": {"same_grouping": period_ratio(cal, same["us_per_event"]),
                          "same_grouping_same_rate": period_ratio(cal, paced["us_per_event"])}}
    doc["floors"] = {_tag(*k): v for k, v in floors.items()}
    profiles: dict[str, str | None] = {}
    # the default configuration's profile, and the multi-step one's where that variant ran
    for stem, pcfg in [("calserve_profile", cfg), *(
            [("calserve_multi_step_profile", configs["calserve_multi_step"][2])]
            if "calserve_multi_step" in configs else [])]:
        try:
            profiles[stem] = _profile(pcfg, out, min(dur, 5.0), stem)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:  # a profile is a bonus
            profiles[stem] = f"profiling failed: {e}"[:300]
    prof = profiles["calserve_profile"]
    head = doc["variants"]["calserve"]
    doc.update({"calserve": head["calserve"], "floor": floors[(head["floor_event_bytes"], 1.0, 0.0)],
                "ratio_per_event": head["ratio_per_event"], "ratio_per_token": head["ratio_per_token"],
                "ratio_per_token_host_only": head["ratio_per_token_host_only"],
                "target_ratio": 1.25,
                "ratio_per_token_same_grouping": {
                    k: v["ratio_per_token_same_grouping"] for k, v in doc["variants"].items()},
                "ratio_per_token_same_grouping_same_rate": {
                    k: v["ratio_per_token_same_grouping_same_rate"]
                    for k, v in doc["variants"].items()},
                "target_ratio_same_grouping": 2.0,
                "ratio_per_token_device_paced": (
                    doc["variants"]["calserve_device_paced"]["ratio_per_token_same_grouping_same_rate"]
                    if "calserve_device_paced" in doc["variants"] else None),
                "ratio_per_token_device_paced_multi_step": (
                    doc["variants"]["calserve_device_paced_multi_step"][
                        "ratio_per_token_same_grouping_same_rate"]
                    if "calserve_device_paced_multi_step" in doc["variants"] else None),
                "ratio_per_token_device_paced_host_multi_step": (
                    doc["variants"][HOST_VARIANT]["ratio_per_token_same_grouping_same_rate"]
                    if HOST_VARIANT in doc["variants"] else None),
                "profile": prof or
                "none saved: install py-spy or `pip install pyinstrument` to get one",
                "profile_multi_step": profiles.get("calserve_multi_step_profile")})
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.http_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=BENCH_OUT / "http-floor")
    ap.add_argument("--stream-interval-ms", type=int, default=0,
                    help="also run calserve with a fixed server.stream_interval_ms (what-if)")
    ap.add_argument("--multi-step", type=int, default=8,
                    help="also run calserve with scheduler.batch.multi_step N (0: not)")
    ap.add_argument("--no-device-paced", action="store_true",
                    help="skip the variant on a timed device (calserve below saturation)")
    a = ap.parse_args(argv)
    pin_self(1)
    doc = run(a.out, a.quick, a.stream_interval_ms, a.multi_step, not a.no_device_paced)
    write_json(a.out / "summary.json", {"scenario": "http-floor", **doc})
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
