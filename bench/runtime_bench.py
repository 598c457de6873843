"""calrt-sim decode throughput at B1/B4/B16 for a ~30M-parameter Qwen3 config vs the numpy reference,
or of a real package (``--package PKG``, e.g. SmolLM2 packed with ``calserve pack --from-gguf``).

Run: ``.venv/bin/python bench/runtime_bench.py [--steps 16] [--package PKG]``. Prints tokens/s per
batch size (timing ``none``: the kernels' own speed), the speed-up over :class:`ReferenceModel` (numpy,
one sequence) and the B16 step cost vs 16x the B1 step, all in one run. Not a test: figures depend on
the machine and its load (the kernels use ``CALRT_SIM_THREADS`` worker threads, default: every CPU).

``--sampler``: the per-token cost of the sampler features on a 49,152-token vocabulary
(:mod:`bench.sampler_cost`: greedy, seeded, top-k/top-p, penalties, ``logit_bias``, ``min_p``, and
constrained decoding on and off) measured in the same run after the steps, and the tokens/s at B1
and B16 with each feature: the step plus the host's sampling of that step, one after the other (one
job in flight, the default configuration; with PING/PONG the sampling overlaps the next step).

``--paired N``: the B16 / B1 ratio pair by pair: the B1, B16 and B16 PING/PONG calbins loaded at
once, N times one step of each and the same backwards (:func:`paired_ratios`), so a pair's B1 and
B16 steps see the same minute of the box (its memory's speed and its neighbours move between the
rounds' separate runs); the per-pair ratios' quartiles and how many reach 8x.

``--llama-cpp GGUF [--llama-python PY]``: llama.cpp's single-stream decode rate on the same weights
beside it (llama-cpp-python, run by the interpreter PY in a subprocess, 1 and 2 threads), interleaved
with the calrt-sim runs round by round (``--rounds``), best of each, and the ratios: one run on one
box, both sides under the same load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

if not __package__:  # run as a script (``python bench/runtime_bench.py``, as documented): the
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repository's bench package

from bench.sampler_cost import VOCAB, run as sampler_run  # noqa: E402
from calserve.runtime import Device, JobEngine, JobStatus, ProfileSpec  # noqa: E402
from calserve.runtime.reference import ModelConfig, ReferenceModel, random_weights  # noqa: E402

CFG = ModelConfig(
    vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=7,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
)
PROMPT = 32


class Lanes:
    """One loaded calbin of compiled batch ``batch`` (all lanes active), its lanes prefilled with
    ``prompt`` random tokens each; :meth:`step` runs one greedy decode step of every lane (``engines``
    = 2: one job of each of two groups of ``batch`` sequences in flight at once, on PING and on PONG)
    and returns its wall-clock seconds. ``steps``: how many :meth:`step` calls the profile's length
    must allow. Close with :meth:`release`."""

    def __init__(self, dev: Device, w: dict[str, np.ndarray], batch: int, steps: int,
                 cfg: ModelConfig = CFG, prompt: int = PROMPT, engines: int = 1) -> None:
        self.cb = cb = dev.load_calbin(cfg, w, ProfileSpec(batch, prompt + steps + 9, batch * engines))
        self.batch = batch
        try:
            rng = np.random.default_rng(batch)
            self.groups: list[tuple[list[int], list[int]]] = []
            for _ in range(engines):
                seqs = [cb.create_sequence() for _ in range(batch)]
                toks = []
                for s in seqs:
                    r = cb.submit_prefill(s, rng.integers(0, cfg.vocab_size, prompt)).wait(600)
                    assert r.status is JobStatus.OK
                    toks.append(int(np.argmax(r.logits[0])))
                self.groups.append((seqs, toks))
        except BaseException:
            cb.release()
            raise

    def step(self) -> float:
        cb = self.cb
        t0 = time.perf_counter()
        jobs = [cb.submit_decode(seqs, toks, [cb.committed_len(s) for s in seqs], [True] * self.batch,
                                 JobEngine.PONG if g else JobEngine.PING)
                for g, (seqs, toks) in enumerate(self.groups)]
        for g, job in enumerate(jobs):
            r = job.wait(600)
            assert r.status is JobStatus.OK
            # greedy, as the server draws a batch's tokens: one argmax over the rows
            # (sampler.greedy_argmax), not one call per row (16 calls over SmolLM2's
            # 49,152-entry rows: ~71 µs against ~47, warm, in a micro-benchmark)
            self.groups[g][1][:] = r.logits.argmax(axis=1).tolist()
        return time.perf_counter() - t0

    def release(self) -> None:
        self.cb.release()


def bench_batch(dev: Device, w: dict[str, np.ndarray], batch: int, steps: int, cfg: ModelConfig = CFG,
                reps: int = 1, prompt: int = PROMPT, engines: int = 1) -> tuple[float, float]:
    """Seconds per decode step at compiled batch ``batch`` (all lanes active), wall clock and CPU time
    of the process (all threads; a waiting worker thread spins a few microseconds before it sleeps,
    so with several threads CPU time over-counts a little): the best of ``reps`` runs of ``steps``
    steps each, after one warm-up step. ``prompt``: tokens prefilled per lane first (the context
    each step's attention reads). ``engines=2``: two groups of ``batch`` sequences, each step one
    job of each in flight at once, on PING and on PONG (sim-next's serving mode under load); the
    figures are then per ``batch`` tokens (the pair's time / 2), comparable with ``engines=1``."""
    lanes = Lanes(dev, w, batch, reps * steps, cfg, prompt, engines)
    try:
        best, best_cpu = float("inf"), float("inf")
        for rep in range(-1, reps):  # rep -1: one warm-up step (first-touch of the pages)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(1 if rep < 0 else steps):
                lanes.step()
            if rep >= 0:
                best = min(best, (time.perf_counter() - t0) / steps / engines)
                best_cpu = min(best_cpu, (time.process_time() - c0) / steps / engines)
        return best, best_cpu
    finally:
        lanes.release()


def paired_ratios(steps: Sequence[Callable[[], float]], pairs: int) -> list[list[float]]:
    """Several step kinds measured side by side at the finest grain (``steps[0]`` B1, then B16
    ones): ``pairs`` times, each kind's step in order and then in reverse order (A B C C B A: a
    drift of the box's speed inside a pair weighs on every kind alike, and every sequence's
    context grows by two steps a pair). Each pair's mean step of each kind, in seconds (B16
    aggregate / B1 = ``16 * t[0] / t[k]``). One warm-up step of each kind first."""
    for step in steps:
        step()
    out = []
    for _ in range(pairs):
        ts = [step() for step in steps]
        for k in range(len(steps) - 1, -1, -1):
            ts[k] += steps[k]()
        out.append([t / 2 for t in ts])
    return out


def paired_line(label: str, ratios: list[float], bar: float = 8.0) -> str:
    """Per-pair B16 aggregate / B1 ratios of :func:`paired_ratios`: quartiles, extremes, and how
    many pairs reach ``bar``."""
    r = sorted(ratios)
    n = len(r)
    q = [r[min(n - 1, int(f * n))] for f in (0.25, 0.5, 0.75)]
    return (f"B16 aggregate / B1, {label}, {n} pairs side by side: median {q[1]:.2f}x,"
            f" quartiles {q[0]:.2f}x-{q[2]:.2f}x, min {r[0]:.2f}x, max {r[-1]:.2f}x;"
            f" {sum(x >= bar for x in r)} of {n} pairs >= {bar:g}x")


def matmul_weights(w: dict[str, np.ndarray]) -> int:
    """Weight elements a decode step multiplies, each once per lane: every matrix of the model (the
    embedding is the head when tied; untied, it is only looked up, one row a token)."""
    n = sum(a.size for a in w.values() if a.ndim == 2)
    if "lm_head.weight" in w:
        n -= w["model.embed_tokens.weight"].size
    return n


def box_line(macs_per_lane: int, weight_bytes: int, b1_s: float, b16_s: float) -> str:
    """What bounds the B16 / B1 ratio on this box. B1 streams every weight once a step (bound by the
    memory's bandwidth), B16 multiplies every weight by 16 lanes (bound by the cores' multiply-add
    rate), so ratio = 16 t1 / t16 = (B16 multiply-adds/s) x (weight bytes / weight) / (B1 bytes/s):
    the box's compute rate over its bandwidth, at F32 4 x G multiply-adds/s / GB/s."""
    bw = weight_bytes / b1_s
    mac = 16 * macs_per_lane / b16_s
    ratio = mac * (weight_bytes / macs_per_lane) / bw
    return (f"box: B1 streams {bw / 1e9:.1f} GB/s of weights, B16 runs {mac / 1e9:.1f} G multiply-adds/s;"
            f" B16 / B1 = {weight_bytes / macs_per_lane:.0f} x multiply-adds/s / bytes/s = {ratio:.1f}x"
            f" (>= 8x while B1 streams <= {ratio * bw / 8e9:.1f} GB/s at this B16 rate)")


def with_sampler(b1_s: float, b16_s: float, rows: dict[str, dict[str, float]]
                 ) -> list[tuple[str, float, float, float]]:
    """Per sampler feature (:func:`bench.sampler_cost.run`'s rows: µs per sampling step of 1 and of
    16 sequences), the tokens/s at B1 and at B16 when each step is followed by that sampling (one
    job in flight: the device waits for the host), and B16 aggregate / B1 with it."""
    out = []
    for name, r in rows.items():
        t1 = b1_s + r["B1_us_per_step"] * 1e-6
        t16 = b16_s + r["B16_us_per_step"] * 1e-6
        out.append((name, 1 / t1, 16 / t16, 16 * t1 / t16))
    return out


def bench_reference(w: dict[str, np.ndarray], steps: int, cfg: ModelConfig = CFG) -> float:
    m = ReferenceModel(cfg, w)
    logits = m.forward(list(range(PROMPT)))[-1]
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = m.forward([int(np.argmax(logits))])[-1]
    return (time.perf_counter() - t0) / steps


# Run by the llama.cpp interpreter: greedy decode `steps` tokens after a short prompt, best of `reps`.
LLAMA_CPP = """
import json, sys, time
import llama_cpp
path, threads, steps, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512,
                      n_batch=64, verbose=False)
prompt = llm.tokenize(b"Once upon a time, there was", add_bos=False)
best = best_cpu = 0.0
for _ in range(reps + 1):  # the first round warms up
    llm.reset()
    llm.eval(prompt)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        llm.eval([llm.sample(temp=0.0)])
    best = max(best, steps / (time.perf_counter() - t0))
    best_cpu = max(best_cpu, steps / (time.process_time() - c0))
print(json.dumps({"tok_s": best, "cpu_tok_s": best_cpu}))
"""


def bench_llama_cpp(python: str, gguf: str, threads: int, steps: int, reps: int) -> tuple[float, float]:
    """llama.cpp's B1 decode tokens/s (best of ``reps``) with ``threads`` threads: per wall-clock
    second and per CPU second of its process."""
    out = subprocess.run([python, "-c", LLAMA_CPP, gguf, str(threads), str(steps), str(reps)],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    res = json.loads(out.strip().splitlines()[-1])
    return float(res["tok_s"]), float(res["cpu_tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--package", metavar="PKG", help="bench this package's model (dev-key signed)")
    ap.add_argument("--no-reference", action="store_true", help="skip the numpy reference")
    ap.add_argument("--reps", type=int, default=3, help="best of REPS runs per batch size")
    ap.add_argument("--prompt", type=int, default=PROMPT,
                    help=f"tokens prefilled per lane before the timed steps (default {PROMPT})")
    ap.add_argument("--llama-cpp", metavar="GGUF", help="also time llama.cpp on this GGUF (same weights)")
    ap.add_argument("--llama-python", metavar="PY", default=sys.executable,
                    help="interpreter with llama-cpp-python (default: this one)")
    ap.add_argument("--sampler", action="store_true",
                    help="also time the sampler features on a 49k vocabulary (bench.sampler_cost) and "
                         "print tokens/s at B1 and B16 with each")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved rounds of calrt-sim and llama.cpp runs (best of all rounds)")
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="also N pairs of single steps side by side, B1, B16, B16 PING/PONG and back "
                         "(the three calbins loaded at once): the B16 / B1 ratio pair by pair")
    args = ap.parse_args()
    cfg = CFG
    if args.package:
        from calserve.models.package import open_package
        from calserve.config import TrustConfig
        from calserve.models.signing import TrustStore

        trust = TrustStore.from_config(TrustConfig())
        vp = open_package(args.package, trust, ".", allow_outside_root=True)
        cfg, w = vp.manifest.model_config(), vp.weights()
    else:
        w = random_weights(CFG, seed=0)
    print(f"config: {cfg.architecture} {cfg.parameter_count() / 1e6:.1f}M parameters, prompt {args.prompt},"
          f" {args.steps} steps")
    ref = None if args.no_reference else bench_reference(w, max(4, args.steps // 2), cfg)
    if ref is not None:
        print(f"numpy reference B1: {ref * 1e3:8.2f} ms/step  {1 / ref:8.1f} tok/s")
    per = {b: float("inf") for b in (1, 4, 16)}
    cpu = dict(per)
    lcp = {t: 0.0 for t in ((1, 2) if args.llama_cpp else ())}
    lcp_cpu = dict(lcp)
    round_ratio: list[float] = []  # each round's B16 aggregate / B1 tok/s (both measured in it)
    round_pp: list[float] = []  # the same with two B16 jobs in flight (PING/PONG)
    pp16, pp16_cpu = float("inf"), float("inf")
    with Device.open("sim-next", dram_bytes=16 << 30) as dev:
        for _ in range(max(1, args.rounds)):
            this = {}
            for b in per:
                wall, cpu_s = bench_batch(dev, w, b, args.steps, cfg, args.reps, args.prompt)
                per[b], cpu[b] = min(per[b], wall), min(cpu[b], cpu_s)
                this[b] = wall
            wall, cpu_s = bench_batch(dev, w, 16, args.steps, cfg, args.reps, args.prompt, engines=2)
            pp16, pp16_cpu = min(pp16, wall), min(pp16_cpu, cpu_s)
            round_ratio.append(16 * this[1] / this[16])
            round_pp.append(16 * this[1] / wall)
            for t in lcp:
                tps, cps = bench_llama_cpp(args.llama_python, args.llama_cpp, t, 2 * args.steps, args.reps)
                lcp[t], lcp_cpu[t] = max(lcp[t], tps), max(lcp_cpu[t], cps)
        pairs: list[list[float]] = []
        if args.paired > 0:
            # B1, B16, B16 PING/PONG, then the same backwards: every sequence's context grows alike
            with contextlib.ExitStack() as stack:
                held = []
                for b, e in ((1, 1), (16, 1), (16, 2)):
                    held.append(Lanes(dev, w, b, 1 + 2 * args.paired, cfg, args.prompt, e))
                    stack.callback(held[-1].release)
                one, sixteen, pp = held
                pairs = paired_ratios([one.step, sixteen.step, lambda: pp.step() / 2], args.paired)
    for b, s in per.items():
        vs = "" if ref is None else f"  speed-up vs numpy {b / s * ref:6.1f}x"
        print(f"calrt-sim B{b:<2}: {s * 1e3:8.2f} ms/step  {b / s:8.1f} tok/s  ({cpu[b] * 1e3:7.2f} ms CPU/step,"
              f" {b / cpu[b]:7.1f} tok per CPU s){vs}")
    print(f"calrt-sim B16 PING/PONG: {pp16 * 1e3:8.2f} ms per 16 tokens  {16 / pp16:8.1f} tok/s  "
          f"({pp16_cpu * 1e3:7.2f} ms CPU, {16 / pp16_cpu:7.1f} tok per CPU s; two B16 jobs in flight, "
          "one per engine)")
    print(f"B16 step = {per[16] / per[1]:.2f} x B1 step (vs 16x if lanes were run one by one); "
          f"B16 costs {per[16] / (16 * per[1]) * 100:.0f}% of 16 B1 steps; "
          f"B16 aggregate = {16 * per[1] / per[16]:.1f} x B1 tok/s (one job in flight), "
          f"{16 * per[1] / pp16:.1f} x with PING/PONG")
    macs = matmul_weights(w)
    print(box_line(macs, macs * 4, per[1], per[16]))  # the runtime computes in F32
    if len(round_ratio) > 1:  # a noisy host: how much the ratio moves from round to round
        rr = sorted(round_ratio)
        print(f"B16 aggregate / B1 per round ({len(rr)} rounds): median {rr[len(rr) // 2]:.1f}x, "
              f"min {rr[0]:.1f}x, max {rr[-1]:.1f}x")
        rp = sorted(round_pp)
        print(f"  with PING/PONG: median {rp[len(rp) // 2]:.1f}x, min {rp[0]:.1f}x, max {rp[-1]:.1f}x")
    if pairs:
        med = [sorted(p[k] for p in pairs)[len(pairs) // 2] for k in range(3)]
        print(f"paired (median steps): B1 {1 / med[0]:.1f} tok/s, B16 {16 / med[1]:.1f} tok/s,"
              f" B16 PING/PONG {16 / med[2]:.1f} tok/s")
        print(paired_line("one job in flight", [16 * p[0] / p[1] for p in pairs]))
        print(paired_line("PING/PONG", [16 * p[0] / p[2] for p in pairs]))
    if args.sampler:
        print(f"\nsampler features, host CPU per sampling step on a {VOCAB:,}-token vocabulary"
              + ("" if cfg.vocab_size == VOCAB else f" (this model's: {cfg.vocab_size:,})") + ":")
        rows = sampler_run(None, quick=False)["rows"]
        print(f"\n{'feature':18} {'B1 tok/s':>9} {'B16 tok/s':>10} {'B16 / B1':>9}"
              "   (the step, then its sampling: one job in flight)")
        free = {"(none)": {"B1_us_per_step": 0.0, "B16_us_per_step": 0.0}}  # the kernels alone
        for name, tps1, tps16, ratio in with_sampler(per[1], per[16], {**free, **rows}):
            print(f"{name:18} {tps1:9.1f} {tps16:10.1f} {ratio:8.1f}x")
    for t, tps in lcp.items():
        print(f"llama.cpp B1 ({t} thread{'s' if t > 1 else ''}): {1e3 / tps:8.2f} ms/step  {tps:8.1f} tok/s"
              f"  ({lcp_cpu[t]:6.1f} tok per CPU s);  calrt-sim B1 / llama.cpp = {1 / per[1] / tps:.2f}x,"
              f"  calrt-sim B16 / llama.cpp = {16 / per[16] / tps:.1f}x")


if __name__ == "__main__":
    main()
