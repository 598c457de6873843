"""A benchmark server started with ``core=None`` runs on every CPU its load generator had before the
generator pinned itself (a child inherits its parent's affinity: the `peer` and `scaleout` servers,
documented as unpinned, shared the load generator's core), and one started with ``core=N`` on core
N. Run in a subprocess: pinning the test process would pin the rest of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.server import REPO

SCRIPT = r"""
import json, os, subprocess, sys
from bench.server import affinity_prefix, pin_self

before = sorted(os.sched_getaffinity(0))
pinned = pin_self(before[-1])
child = [sys.executable, "-c", "import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))"]

def run(prefix):
    return json.loads(subprocess.run(prefix + child, capture_output=True, text=True, check=True).stdout)

print(json.dumps({"before": before, "pinned": pinned, "self": sorted(os.sched_getaffinity(0)),
                  "free": run(affinity_prefix(None)), "one": run(affinity_prefix(before[0]))}))
"""


def test_unpinned_server_gets_every_cpu_back_and_a_pinned_one_its_core() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         env=env, timeout=60).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["pinned"] and got["self"] == [got["before"][-1]]  # the generator is pinned
    assert got["free"] == got["before"]  # core=None: not the generator's one core
    assert got["one"] == [got["before"][0]]
