"""What the GGUF import tests share: a file packed and opened, and the software runtime checked
against a numpy forward written by a test (llama.cpp's graph, in tests/gguf_llama.py or
tests/models/test_gguf_gemma3.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from calserve.models.gguf_import import pack_from_gguf
from calserve.models.package import VerifiedPackage, open_package
from calserve.models.signing import TrustStore, generate_keypair, load_verify_key
from calserve.runtime import Device, JobStatus, ProfileSpec
from calserve.runtime.reference import ModelConfig


def pack_opened(gguf: Path, d: Path) -> VerifiedPackage:
    """``gguf`` packed (profile B1, a fresh key) into ``d`` / pkg and opened, verified."""
    key = d / "key"
    generate_keypair(key)
    pkg = pack_from_gguf(gguf, d / "pkg", key, profiles=(1,))
    return open_package(pkg, TrustStore((load_verify_key(str(key) + ".pub"),)), d,
                        allow_outside_root=True)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def runtime_matches(ref: Any, mc: ModelConfig, weights: Any, prompt: list[int],
                    decode: list[int] | None = None, *, greedy: bool = False) -> None:
    """calrt-sim (B1) computes what ``ref`` (``ref.step(token)`` -> that position's logits, a
    fresh forward) computes, within 1e-4 of the largest logit: one prefill of ``prompt``, then a
    decode step of each token of ``decode`` (None: one step of the runtime's own greedy token).
    ``greedy``: each of those tokens is also the runtime's greedy choice before its step."""
    with Device.open() as dev:
        cb = dev.load_calbin(mc, weights, ProfileSpec(1, 64, 1))
        seq = cb.create_sequence()
        r = cb.submit_prefill(seq, prompt).wait(60)
        assert r.status is JobStatus.OK
        for tok in prompt:
            want = ref.step(tok)
        _close(r.logits[0], want)
        steps = [int(np.argmax(r.logits[0]))] if decode is None else decode
        for i, tok in enumerate(steps):
            if greedy:
                assert int(np.argmax(r.logits[0])) == tok
            r = cb.submit_decode([seq], [tok], [len(prompt) + i], [True]).wait(60)
            _close(r.logits[0], ref.step(tok))
