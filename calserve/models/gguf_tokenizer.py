"""A GGUF file's tokenizer as a Hugging Face ``tokenizers`` JSON, from its metadata alone.

GGUF stores a byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) as the token strings
(already in GPT-2's byte-to-unicode alphabet, ``Ġ`` for a space), the merges (``"a b"``, in priority
order), a type per token (1 normal, 3 control, 4 user-defined, ...), the name of the pre-tokenizer
(``tokenizer.ggml.pre``) and the special token ids. This module rebuilds the equivalent HF tokenizer:

- the BPE model: vocab = the tokens by id, merges as given, no unknown token, no byte fallback;
- the pre-tokenizer named by ``tokenizer.ggml.pre``, with llama.cpp's meaning of that name
  (:data:`PRE_TOKENIZERS`; an unknown name is refused, naming the key, rather than guessed);
- control (type 3) and user-defined (type 4) tokens as added tokens, matched whole in the text
  (``special`` for control tokens, so ``decode(skip_special_tokens=True)`` drops them);
- a post-processor that prepends BOS only when ``tokenizer.ggml.add_bos_token`` is true (and EOS
  only when ``add_eos_token`` is), so ``encode(add_special_tokens=True)`` honours the file;
- the byte-level decoder.

A SentencePiece tokenizer (``tokenizer.ggml.model == "llama"``: Llama 2, TinyLlama, Mistral, ...)
is stored as the pieces (``▁`` for a space), a score per piece and the token types (6 for the
``<0xXX>`` byte pieces); llama.cpp encodes with SentencePiece's BPE: the text, with a space in
front (``tokenizer.ggml.add_space_prefix``, default true) and every space as ``▁``, starts as one
symbol per character, and the adjacent pair whose concatenation is the highest-scoring normal piece
merges first (the leftmost on a tie), until none does; a symbol that is no piece becomes its
UTF-8 bytes' ``<0xXX>`` pieces. The HF equivalent (what ``transformers`` builds for a Llama
SentencePiece model): a BPE model with byte fallback whose merges are every split of a normal
piece into two normal pieces, ranked by the piece's score, behind a normalizer that prepends ``▁``
and replaces spaces, and a decoder that undoes both (``tests/models/test_gguf_spm.py`` checks it
against the ``sentencepiece`` library on a model it trained).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from calserve.errors import ValidationError

__all__ = ["GGUFTokenizer", "PRE_TOKENIZERS", "END_OF_GENERATION", "pre_tokenizer",
           "tokenizer_from_metadata"]

# llama.cpp's regexes (llama-vocab.cpp) for the pre-tokenizer names a GGUF file carries.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split(*patterns: str) -> pre_tokenizers.PreTokenizer:
    """Each regex splits the pieces of the one before (isolating its matches), then the bytes are
    mapped to GPT-2's alphabet with no regex of ByteLevel's own."""
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in patterns
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


# name -> the regexes llama.cpp applies, in order, grouped as llama-vocab.cpp groups the names
# (``smollm`` is starcoder's: every digit alone, then GPT-2's regex).
_DIGITS_GPT2 = (r"\p{N}", _GPT2)
PRE_TOKENIZERS: Mapping[str, tuple[str, ...]] = {
    # llama.cpp's regexes when the name is "default" (or missing)
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("gpt2", "gpt-2", "mpt", "olmo", "phi-2"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone",
                     "minerva-7b"), _DIGITS_GPT2),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "smaug-bpe",
                     "dbrx"), (_LLAMA3,)),
    # deepseek-r1-qwen: DeepSeek-R1's Qwen distillations
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
    **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O,)),  # gpt-4o: Phi-4
    "tekken": (_TEKKEN,),  # Mistral Nemo, Small 3
}
# names under which llama.cpp takes a word that is a token whole before any merge (HF's BPE
# ``ignore_merges``, as Llama 3's tokenizer.json says)
_IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken"))

def pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of ``tokenizer.ggml.pre`` ``name`` (a key of :data:`PRE_TOKENIZERS`)."""
    return _split(*PRE_TOKENIZERS[name])


_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
#: Token texts llama.cpp treats as end of generation whatever the file's EOS id (llama-vocab.cpp).
END_OF_GENERATION = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<end_of_utterance>"))


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    """The tokenizer JSON and the special tokens a GGUF file names."""

    tokenizer_json: str
    bos_token_id: int | None
    # eos, then end-of-turn / end-of-message ids when named, then END_OF_GENERATION tokens
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    tokens: Sequence[str]

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None or not 0 <= token_id < len(self.tokens) else self.tokens[token_id]


def _opt_int(meta: Mapping[str, Any], key: str, n: int) -> int | None:
    v = meta.get(key)
    if v is None:
        return None
    i = int(v)
    if not 0 <= i < n:
        raise ValidationError(f"{key}: token id {i} is outside the vocabulary of {n} tokens")
    return i


def _spm(meta: Mapping[str, Any], tokens: list[str], types: list[int],
         source: str) -> tokenizers.Tokenizer:
    """The SentencePiece (BPE) tokenizer of a ``"llama"`` GGUF vocabulary (module docstring)."""
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or []]
    if len(scores) != len(tokens):
        raise ValidationError(f"{source}: tokenizer.ggml.scores has {len(scores)} entries, not"
                              f" {len(tokens)}")
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, k in zip(tokens, types) if k == _NORMAL}
    ranked: list[tuple[float, int, int, int]] = []  # (-score, piece, left id, right id)
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, vocab[left], vocab[right]))
    ranked.sort()
    merges = [(tokens[a], tokens[b]) for _, _, a, b in ranked]
    unk = next((t for t, k in zip(tokens, types) if k == _UNKNOWN), None)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk,
                                          byte_fallback=True, fuse_unk=True))
    steps: list[normalizers.Normalizer] = []
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if prefix:
        steps.append(normalizers.Prepend("\u2581"))
    steps.append(normalizers.Replace(" ", "\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    undo: list[decoders.Decoder] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse()]
    if prefix:
        undo.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(undo)
    return tok


def _byte_level(meta: Mapping[str, Any], tokens: list[str], source: str) -> tokenizers.Tokenizer:
    """The byte-level BPE tokenizer of a ``"gpt2"`` GGUF vocabulary (module docstring)."""
    merges: list[tuple[str, str]] = []
    for i, m in enumerate(meta.get("tokenizer.ggml.merges") or []):
        a, sep, b = str(m).partition(" ")
        if not sep or not a or not b:
            raise ValidationError(f"{source}: tokenizer.ggml.merges[{i}] is not 'left right': {m!r}")
        merges.append((a, b))
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    if pre not in PRE_TOKENIZERS:
        raise ValidationError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not supported (known: {sorted(PRE_TOKENIZERS)})"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                          ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_from_metadata(meta: Mapping[str, Any], source: str = "gguf") -> GGUFTokenizer:
    """Build the tokenizer from the GGUF key/values ``meta`` (decoded Python values)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValidationError(
            f"{source}: tokenizer.ggml.model is {kind!r}; supported: byte-level BPE ('gpt2') and"
            " SentencePiece BPE ('llama')"
        )
    tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens") or []]
    if not tokens:
        raise ValidationError(f"{source}: tokenizer.ggml.tokens is missing or empty")
    n = len(tokens)
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [1] * n]
    if len(types) != n:
        raise ValidationError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries, not {n}")
    if len(set(tokens)) != n:
        raise ValidationError(f"{source}: tokenizer.ggml.tokens has duplicate tokens")
    tok = _spm(meta, tokens, types, source) if kind == "llama" else _byte_level(meta, tokens, source)
    added = [
        AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
        for i in range(n)
        if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)
    bos = _opt_int(meta, "tokenizer.ggml.bos_token_id", n)
    eos = _opt_int(meta, "tokenizer.ggml.eos_token_id", n)
    pad = _opt_int(meta, "tokenizer.ggml.padding_token_id", n)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{tokens[bos]}:0"] if add_bos and bos is not None else []) + ["$A:0"]
    if add_eos and eos is not None:
        single.append(f"{tokens[eos]}:0")
    specials = [(tokens[i], i) for i in {j for j in (bos, eos) if j is not None}]
    if add_bos or add_eos:
        pair = single + [p.replace("$A", "$B").replace(":0", ":1") for p in single]
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials
        )
    eos_ids: list[int] = [] if eos is None else [eos]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = _opt_int(meta, key, n)
        if extra is not None and extra not in eos_ids:
            eos_ids.append(extra)
    # the end-of-generation tokens llama.cpp recognises by their text (a Llama 3 GGUF whose EOS is
    # <|end_of_text|> still ends a chat turn at <|eot_id|>; Phi-3's turns end at <|end|>)
    for i, t in enumerate(tokens):
        if t in END_OF_GENERATION and i not in eos_ids:
            eos_ids.append(i)
    tmpl = meta.get("tokenizer.chat_template")
    return GGUFTokenizer(
        tokenizer_json=str(tok.to_str()),
        bos_token_id=bos,
        eos_token_ids=tuple(eos_ids),
        pad_token_id=pad,
        add_bos_token=add_bos,
        chat_template=str(tmpl) if isinstance(tmpl, str) and tmpl else None,
        tokens=tokens,
    )
