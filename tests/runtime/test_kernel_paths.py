"""calrt-sim's CPU code paths (``CALRT_SIM_ISA`` default / avx2 / avx512 / avx512z, see
ext/calrt/sim/matmul.c) and worker-thread counts compute bitwise the same logits end to end: a Qwen3
and a Llama model of odd sizes (hidden 100: not a multiple of 8; 120 query outputs: not a multiple of
any tile), a long prefill (parallel attention), B16 decode with idle lanes (an odd lane count: avx512z
pairs the last lane with zeros), fp32 and bf16 KV. Each setting runs in its own process (the path is
chosen once per process). The C test ``make -C ext/calrt asan-test`` checks each path against the
scalar reduction element by element; this one checks the whole pass (and a Qwen2: its biases; a Gemma 3:
its norms, GELU and a sliding layer of window 100, of which the long prefill's later rows and that
sequence's decode steps see only part; a Gemma 2: the same without q/k norms, its attention scores and
logits soft-capped at 2 and 1.5, caps that bite)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

RUN = r"""
import sys
import numpy as np
from calserve.runtime import Device, JobStatus, ProfileSpec
from calserve.runtime.reference import ModelConfig, random_weights

out = []
for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM",
             "Gemma2ForCausalLM"):
    gemma = arch.startswith("Gemma")  # layer 0 slides (Gemma 3: its own RoPE base), layer 1 is global
    gemma2 = arch == "Gemma2ForCausalLM"  # and soft-capped scores and logits
    cfg = ModelConfig(vocab_size=1003, hidden_size=100, intermediate_size=236, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=20, rope_theta=1e5,
                      tie_word_embeddings=arch == "LlamaForCausalLM", architecture=arch,
                      sliding_window=100 if gemma else 0, sliding_window_pattern=2 if gemma else 0,
                      rope_local_theta=1e4 if gemma and not gemma2 else 0.0,
                      query_pre_attn_scalar=24.0 if gemma else 0.0,
                      attn_logit_softcapping=2.0 if gemma2 else 0.0,
                      final_logit_softcapping=1.5 if gemma2 else 0.0)
    w = random_weights(cfg, seed=7)
    rng = np.random.default_rng(3)
    with Device.open("sim-next", dram_bytes=1 << 30) as dev:
        for kv in ("fp32", "bf16"):
            cb = dev.load_calbin(cfg, w, ProfileSpec(16, 320, 17, kv_dtype=kv))
            seqs = [cb.create_sequence() for _ in range(16)]
            toks = []
            for i, s in enumerate(seqs):
                r = cb.submit_prefill(s, rng.integers(0, cfg.vocab_size, 260 if i == 0 else 5 + i)).wait(120)
                assert r.status is JobStatus.OK
                out.append(r.logits[0].copy())
                toks.append(int(np.argmax(r.logits[0])))
            valid = [i % 5 != 3 for i in range(16)]
            for _ in range(3):
                r = cb.submit_decode(seqs, toks, [cb.committed_len(s) for s in seqs], valid).wait(120)
                assert r.status is JobStatus.OK
                out.extend(r.logits[i].copy() for i in range(16) if valid[i])
                toks = [int(np.argmax(x)) for x in r.logits]
            cb.release()
np.save(sys.argv[1], np.stack(out))
"""


def _run(tmp: Path, isa: str, threads: int) -> np.ndarray:
    dst = tmp / f"{isa}-{threads}.npy"
    env = dict(os.environ, CALRT_SIM_ISA=isa, CALRT_SIM_THREADS=str(threads))
    subprocess.run([sys.executable, "-c", RUN, str(dst)], check=True, env=env, timeout=240)
    return np.asarray(np.load(dst), dtype=np.float32)


def test_isa_paths_and_threads_bitwise_equal(tmp_path: Path) -> None:
    base = _run(tmp_path, "default", 1)
    assert base.shape[0] == 5 * 2 * (16 + 3 * 13) and np.isfinite(base).all()
    for isa, threads in (("default", 2), ("avx2", 1), ("avx2", 2), ("avx512", 1), ("avx512", 2),
                         ("avx512z", 1), ("avx512z", 2)):
        got = _run(tmp_path, isa, threads)
        assert np.array_equal(base.view(np.uint32), got.view(np.uint32)), (isa, threads)


PINGPONG = r"""
import sys
import numpy as np
from calserve.runtime import Device, JobEngine, JobStatus, ProfileSpec
from calserve.runtime.reference import ModelConfig, random_weights

# large enough that every matmul region runs on the pool (kernels.c: SIM_PARALLEL_MIN)
cfg = ModelConfig(vocab_size=1003, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1e5,
                  tie_word_embeddings=True, architecture="LlamaForCausalLM")
w = random_weights(cfg, seed=11)
rng = np.random.default_rng(5)
prompts = [rng.integers(0, cfg.vocab_size, 40 + i).tolist() for i in range(16)]
with Device.open("sim-next", dram_bytes=1 << 30) as dev:
    cb = dev.load_calbin(cfg, w, ProfileSpec(8, 128, 32))

    def start(group):
        seqs = [cb.create_sequence() for _ in group]
        toks = []
        for s, p in zip(seqs, group):
            r = cb.submit_prefill(s, p).wait(120)
            assert r.status is JobStatus.OK
            toks.append(int(np.argmax(r.logits[0])))
        return [seqs, toks]

    def submit(g, engine):
        seqs, toks = g
        return cb.submit_decode(seqs, toks, [cb.committed_len(s) for s in seqs], [True] * 8, engine)

    def finish(g, job, out):
        r = job.wait(120)
        assert r.status is JobStatus.OK
        out.append(r.logits.copy())
        g[1] = [int(np.argmax(x)) for x in r.logits]

    alone, together = [], []
    a, b = start(prompts[:8]), start(prompts[8:])
    for _ in range(4):  # one job at a time: each on every thread of its engine's pool
        finish(a, submit(a, JobEngine.PING), alone)
        finish(b, submit(b, JobEngine.PING), alone)
    a, b = start(prompts[:8]), start(prompts[8:])
    for _ in range(4):  # both engines computing at once: the pools split the CPUs
        ja, jb = submit(a, JobEngine.PING), submit(b, JobEngine.PONG)
        finish(a, ja, together)
        finish(b, jb, together)
    cb.release()
np.save(sys.argv[1], np.stack([np.stack(alone), np.stack(together)]))
"""


def test_engines_computing_at_once_bitwise_equal_alone(tmp_path: Path) -> None:
    """Two jobs computing at once on PING and PONG (their pools then share the CPUs: pool.c's
    sim_pool_share) give bitwise the logits each gives computing alone, for pools of 2 threads
    (one each while both compute) and of 4 (two each)."""
    for threads in (2, 4):
        dst = tmp_path / f"pp-{threads}.npy"
        env = dict(os.environ, CALRT_SIM_THREADS=str(threads))
        subprocess.run([sys.executable, "-c", PINGPONG, str(dst)], check=True, env=env, timeout=240)
        alone, together = np.load(dst)
        assert alone.shape == (8, 8, 1003) and np.isfinite(alone).all()
        assert np.array_equal(alone.view(np.uint32), together.view(np.uint32)), threads
