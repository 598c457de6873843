"""The tokenizer ``pack --from-gguf`` rebuilds from SmolLM2's GGUF metadata (a HF ``tokenizers`` JSON)
against ids recorded from an independent implementation: llama.cpp's own tokenizer, reading the same
GGUF file (fixtures/smollm2_token_ids.json, made by fixtures/make_smollm2_token_ids.py).

Also: a Unicode corpus round-trips; ``tokenizer.ggml.add_bos_token`` (false for SmolLM2) is honoured
by ``add_special_tokens=True``; ``tokenizer.ggml.pre = smollm`` splits digits one by one; special
tokens are whole tokens, skipped by ``decode(skip_special_tokens=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from calserve.models.gguf_import import resolve_gguf_path
from calserve.models.gguf_tokenizer import GGUFTokenizer, tokenizer_from_metadata
from calserve.models.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def meta() -> dict[str, Any]:
    import gguf

    from conftest import SMOLLM2_GGUF  # tests/conftest.py

    r = gguf.GGUFReader(str(resolve_gguf_path(SMOLLM2_GGUF)))
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def gt(meta: dict[str, Any]) -> GGUFTokenizer:
    return tokenizer_from_metadata(meta)


@pytest.fixture(scope="module")
def tok(gt: GGUFTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    p.write_text(gt.tokenizer_json, "utf-8")
    return Tokenizer.from_file(p, gt.eos_token_ids)


def test_ids_equal_llamacpp_tokenizer(tok: Tokenizer) -> None:
    fx = json.loads((FIXTURES / "smollm2_token_ids.json").read_text("utf-8"))
    assert "llama.cpp" in fx["source"]
    assert len(fx["cases"]) >= 25
    for c in fx["cases"]:
        assert tok.encode(c["text"], add_special_tokens=True) == c["ids"], c["text"]


def test_unicode_corpus_round_trips(tok: Tokenizer) -> None:
    text = (FIXTURES / "tokenizer_corpus.txt").read_text("utf-8")
    for line in [*text.split("\n"), text]:
        ids = tok.encode(line)
        assert tok.decode(ids, skip_special_tokens=False) == line
        assert all(0 <= i < tok.vocab_size for i in ids)


def test_add_bos_false_pre_smollm_and_specials(meta: dict[str, Any], gt: GGUFTokenizer,
                                                tok: Tokenizer) -> None:
    assert meta["tokenizer.ggml.add_bos_token"] is False and meta["tokenizer.ggml.pre"] == "smollm"
    assert not gt.add_bos_token
    assert tok.encode("Hello", add_special_tokens=True) == tok.encode("Hello")  # no BOS
    assert gt.bos_token_id == 1 and gt.eos_token_ids == (2, 0) and gt.token(2) == "<|im_end|>"
    assert gt.token(0) == "<|endoftext|>"  # an end of generation by its text (llama.cpp's list)
    # smollm: every digit is its own pre-token (then GPT-2's regex)
    assert [tok.id_to_token(i) for i in tok.encode("12345")] == list("12345")
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nHi"  # specials skipped
    assert {0, 1, 2} <= tok.special_token_ids


def test_add_bos_true_adds_bos(meta: dict[str, Any], tmp_path: Path) -> None:
    gt = tokenizer_from_metadata({**meta, "tokenizer.ggml.add_bos_token": True})
    p = tmp_path / "tokenizer.json"
    p.write_text(gt.tokenizer_json, "utf-8")
    t = Tokenizer.from_file(p)
    assert t.encode("Hello", add_special_tokens=True) == [1, *t.encode("Hello")]
