"""Batch invariance on the real Llama: SmolLM2's lanes in a B16 job (sim-next) are bitwise equal to
the same sequences run alone at B1, prefill and decode, with the kernels' worker threads."""

from __future__ import annotations

from typing import Any

import numpy as np

from calserve.models.package import open_package
from calserve.models.signing import TrustStore, load_verify_key
from calserve.runtime import Device, JobStatus, ProfileSpec


def test_smollm2_b16_lanes_bitwise_equal_b1(smollm2: Any) -> None:
    vp = open_package(smollm2.package, TrustStore((load_verify_key(smollm2.pub),)), smollm2.package.parent,
                      allow_outside_root=True)
    cfg, w = vp.manifest.model_config(), vp.weights()
    assert cfg.architecture == "LlamaForCausalLM"
    prompts = {0: [504, 2540, 9625, 100, 30017, 69], 5: [1, 4093, 198, 19556, 28], 15: [33, 28, 216, 34, 28]}
    steps = 3
    with Device.open("sim-next", dram_bytes=4 << 30) as dev:
        cb1 = dev.load_calbin(cfg, w, ProfileSpec(1, 64, 1))
        alone: dict[int, list[np.ndarray]] = {}
        for lane, p in prompts.items():
            s = cb1.create_sequence()
            r = cb1.submit_prefill(s, p).wait(120)
            rows, tok = [r.logits[0].copy()], int(np.argmax(r.logits[0]))
            for _ in range(steps):
                r = cb1.submit_decode([s], [tok], [cb1.committed_len(s)], [True]).wait(120)
                rows.append(r.logits[0].copy())
                tok = int(np.argmax(r.logits[0]))
            alone[lane] = rows
            cb1.free_sequence(s)
        cb1.release()
        cb16 = dev.load_calbin(cfg, w, ProfileSpec(16, 64, 17))
        seqs = {lane: cb16.create_sequence() for lane in prompts}
        idle = cb16.create_sequence()
        toks = {}
        for lane, p in prompts.items():
            r = cb16.submit_prefill(seqs[lane], p).wait(120)
            assert np.array_equal(r.logits[0], alone[lane][0]), lane
            toks[lane] = int(np.argmax(r.logits[0]))
        for step in range(steps):
            ids = [seqs.get(lane, idle) for lane in range(16)]
            pos = [cb16.committed_len(seqs[lane]) if lane in seqs else 0 for lane in range(16)]
            r = cb16.submit_decode(ids, [toks.get(lane, 0) for lane in range(16)], pos,
                                   [lane in seqs for lane in range(16)]).wait(120)
            assert r.status is JobStatus.OK
            for lane in prompts:
                assert np.array_equal(r.logits[lane], alone[lane][step + 1]), (lane, step)
                toks[lane] = int(np.argmax(r.logits[lane]))
        cb16.release()
