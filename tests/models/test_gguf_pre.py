"""The pre-tokenizers of GGUF BPE vocabularies (``tokenizer.ggml.pre``, calserve/models/
gguf_tokenizer.py) split text as llama.cpp's regexes do: each name's HF ``tokenizers`` pre-tokenizer
(the Oniguruma engine) against the same name's regexes as llama.cpp's llama-vocab.cpp lists them
(copied here, with llama.cpp's own case-folding rewrites where it made them), applied one after the
other with Python's ``regex`` module, a second engine, on a corpus with contractions in every
case, digits, Unicode letters and marks, CJK, emoji, punctuation runs, paths and whitespace runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import regex

from calserve.models.gguf_tokenizer import PRE_TOKENIZERS, pre_tokenizer

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's and Tekken's as their tokenizer.json has them (llama.cpp rewrites \p{Lu}... away)
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
         r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
         r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DIGITS_GPT2 = (r"\p{N}", GPT2)
LLAMACPP: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("gpt2", "gpt-2", "mpt", "olmo", "phi-2"), (GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone",
                     "minerva-7b"), DIGITS_GPT2),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "smaug-bpe",
                     "dbrx"), (LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (QWEN2,)),
    "qwen35": (QWEN35,),
    **dict.fromkeys(("gpt-4o", "llama4"), (GPT4O,)),
    "tekken": (TEKKEN,),
}

CORPUS = (Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt").read_text("utf-8")
EXTRA = [
    "I'M sure it'S THEY'LL we'D you'Re", "Don't DON'T don’t", "1234567 3.14159 +12,345",
    "naïve e\u0301te\u0301 Ελληνικά КИРИЛЛИЦА", "日本語のテキストと中文句子。", "emoji 🙂🙂 ∑∞",
    "!!! ??? ... --> /usr/bin/env", "a\n\nb\r\n\tc   d    \n  ", "CamelCaseWord lowerUPPER",
    "  leading and trailing  ", "x" * 30 + "'s",
]


def _llamacpp_split(text: str, patterns: tuple[str, ...]) -> list[str]:
    """Each pattern splits the pieces of the one before: its matches and the text between them."""
    pieces = [text]
    for pat in patterns:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pat, piece):
                if m.start() > pos:
                    out.append(piece[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


def _byte_level(s: str) -> str:
    """GPT-2's byte-to-character mapping (``bytes_to_unicode``), written out here."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return "".join(table[b] for b in s.encode("utf-8"))


def test_every_name_is_checked() -> None:
    assert set(PRE_TOKENIZERS) == set(LLAMACPP)


@pytest.mark.parametrize("name", sorted(LLAMACPP))
def test_pre_tokenizer_splits_as_llamacpp(name: str) -> None:
    pre = pre_tokenizer(name)
    for text in [*CORPUS.split("\n"), CORPUS, *EXTRA]:
        got = [p for p, _ in pre.pre_tokenize_str(text)]
        want = [_byte_level(p) for p in _llamacpp_split(text, LLAMACPP[name])]
        assert got == want, (name, text)


def test_llama3_takes_a_whole_word_token_before_merges() -> None:
    """llama.cpp's ``ignore_merges`` for Llama 3 (as its tokenizer.json): a word that is a token
    is that token even when no merge builds it; other names merge as the merges say."""
    import tokenizers

    from calserve.models.gguf_tokenizer import tokenizer_from_metadata

    tokens = ["a", "b", "c", "ab", "abc", "<|eot_id|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3], "tokenizer.ggml.merges": ["a b"]}
    for pre, want in (("llama-bpe", ["abc"]), ("gpt2", ["ab", "c"])):
        g = tokenizer_from_metadata({**meta, "tokenizer.ggml.pre": pre})
        t = tokenizers.Tokenizer.from_str(g.tokenizer_json)
        assert t.encode("abc").tokens == want, pre
