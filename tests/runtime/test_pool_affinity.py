"""The software runtime's worker threads inside a job: as many as the CPUs the process may run on
(its affinity mask, as ``nproc`` counts), not the CPUs online. A server pinned to one core (the
benchmarks' servers, one replica per core) computes on one thread: a second one on the same core
would only take turns with the first and spin while it waits.

Each case runs in a subprocess (affinity is per process, and the pool is created once per engine
thread); the threads are counted by name in /proc (helpers inherit their engine thread's name)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, sys
cpus = json.loads(sys.argv[1])
if cpus:
    os.sched_setaffinity(0, set(cpus))
from calserve.runtime import Device, JobStatus, ProfileSpec
from calserve.runtime.reference import ModelConfig, random_weights
# large enough that a prefill's matmuls run on the pool (SIM_PARALLEL_MIN multiply-adds)
cfg = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
with Device.open("calrt-0.7.6", dram_bytes=1 << 30) as dev:
    cb = dev.load_calbin(cfg, random_weights(cfg, seed=1), ProfileSpec(1, 64, 2))
    s = cb.create_sequence()
    assert cb.submit_prefill(s, list(range(1, 33))).wait(30).status is JobStatus.OK
    names = []
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/comm") as f:
            names.append(f.read().strip())
    print(json.dumps({"ping": names.count("calrt-sim-ping0"), "usable": len(os.sched_getaffinity(0))}))
    cb.free_sequence(s)
"""


def _threads(cpus: list[int]) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "CALRT_SIM_THREADS"}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cpus)], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_pool_threads_follow_the_affinity_mask() -> None:
    usable = sorted(os.sched_getaffinity(0))
    pinned = _threads(usable[:1])
    assert pinned == {"ping": 1, "usable": 1}
    free = _threads(usable)
    assert free == {"ping": min(len(usable), 16), "usable": len(usable)}
