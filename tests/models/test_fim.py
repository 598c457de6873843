"""Fill-in-the-middle tokens found by name (``calserve/models/fim.py``, llama.cpp's table), on
every family's names and on a GGUF-imported tokenizer: the FIM prompt of a prefix and a suffix is
the same ids as the prompt a client writes out in text with the special tokens (what editors
sending raw FIM prompts do), BOS as the model wants it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from calserve.models.fim import FIM_NAMES, FimTokens, find_fim
from calserve.models.gguf_import import resolve_gguf_path
from calserve.models.gguf_tokenizer import tokenizer_from_metadata
from calserve.models.tokenizer import Tokenizer

FAMILIES = {  # (prefix, suffix, middle, ends) as each family's vocabulary spells them
    "qwen2.5-coder": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                      ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")),
    "starcoder/granite": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<fim_pad>", "<reponame>")),
    "deepseek-coder": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", ()),
    "codellama": ("▁<PRE>", "▁<SUF>", "▁<MID>", ()),
    "glm-4.5": ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>", ()),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_names(family: str) -> None:
    pre, suf, mid, ends = FAMILIES[family]
    vocab = {t: 1000 + i for i, t in enumerate([pre, suf, mid, *ends, "<|endoftext|>", "a"])}
    fim = find_fim(vocab.get)
    assert fim is not None
    assert (fim.pre, fim.suf, fim.mid, fim.ends) == (vocab[pre], vocab[suf], vocab[mid],
                                                     tuple(vocab[e] for e in ends))
    assert fim.prompt([1, 2], [3]) == [vocab[pre], 1, 2, vocab[suf], 3, vocab[mid]]
    for missing in (pre, suf, mid):  # all three or none
        assert find_fim({k: v for k, v in vocab.items() if k != missing}.get) is None


def test_first_name_in_the_table_wins_and_ends_are_unique() -> None:
    vocab = {"<|fim_prefix|>": 1, "<fim_prefix>": 2, "<|fim_suffix|>": 3, "<|fim_middle|>": 4,
             "<|fim_repo|>": 5, "<|repo_name|>": 6, "<|file_sep|>": 5}
    fim = find_fim(vocab.get)
    assert fim is not None and fim.pre == 1 and fim.ends == (5,)
    assert all(names for names in FIM_NAMES.values())


@pytest.fixture(scope="module")
def meta() -> dict[str, Any]:
    import gguf

    from conftest import SMOLLM2_GGUF  # tests/conftest.py

    r = gguf.GGUFReader(str(resolve_gguf_path(SMOLLM2_GGUF)))
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}


def _packed(meta: dict[str, Any], tmp_path: Path, **over: Any) -> Tokenizer:
    gt = tokenizer_from_metadata({**meta, **over})
    p = tmp_path / "tokenizer.json"
    p.write_text(gt.tokenizer_json, "utf-8")
    return Tokenizer.from_file(p, gt.eos_token_ids, bos_token_id=gt.bos_token_id,
                               add_bos_token=gt.add_bos_token)


@pytest.mark.parametrize("add_bos", [False, True])
def test_gguf_tokenizer_with_fim_tokens(meta: dict[str, Any], tmp_path: Path, add_bos: bool) -> None:
    """SmolLM2's GGUF vocabulary has StarCoder's repo and file tokens but no FIM prefix, suffix
    or middle: no FIM. Three of its control tokens renamed to StarCoder's FIM names (as a
    StarCoder-family GGUF has them): found, and the FIM prompt equals the text one."""
    assert _packed(meta, tmp_path).fim is None
    tokens = list(meta["tokenizer.ggml.tokens"])
    assert tokens[11:14] == ["<jupyter_start>", "<jupyter_text>", "<jupyter_code>"]
    tokens[11:14] = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
    tokens[15] = "<fim_pad>"
    tok = _packed(meta, tmp_path, **{"tokenizer.ggml.tokens": tokens,
                                     "tokenizer.ggml.add_bos_token": add_bos})
    assert tok.fim == FimTokens(11, 12, 13, (15, 4), rep=4)  # pad, then <reponame> (repo)
    prefix, suffix = "def add(a, b):\n    c = ", "\n    return c\n"
    ids = tok.with_bos(tok.fim.prompt(tok.encode(prefix), tok.encode(suffix)))
    text = f"<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"
    assert ids == tok.encode(text, add_special_tokens=True)
    assert (ids[0] == 1) == add_bos
