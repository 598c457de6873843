"""Fill-in-the-middle (FIM): the tokens a code model was trained to complete the middle of a file
with, found by name in its vocabulary as llama.cpp finds them (``llama-vocab.cpp``: Qwen2.5-Coder's
``<|fim_prefix|>``, StarCoder/Granite's ``<fim_prefix>``, DeepSeek-Coder's ``<｜fim▁begin｜>``,
CodeLlama's ``▁<PRE>``, GLM-4.5's ``<|code_prefix|>``, ...), and the prompt it expects
(prefix-suffix-middle order, what llama.cpp's ``/infill`` and the models' own docs write)::

    [BOS] FIM_PRE prefix FIM_SUF suffix FIM_MID   -> the model writes the middle

A model has FIM when its vocabulary holds a prefix, a suffix and a middle token. Its FIM pad, repo
and file-separator tokens (when present) end a FIM completion, as llama.cpp ends generation on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

__all__ = ["FimTokens", "find_fim", "FIM_NAMES"]

# llama.cpp's table (llama-vocab.cpp), first match wins
FIM_NAMES: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}


@dataclasses.dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    ends: tuple[int, ...] = ()  # pad, repo, file separator: each ends a FIM completion
    rep: int | None = None  # the repository-name token (llama.cpp's repo-level context)
    sep: int | None = None  # the file-separator token (ditto)

    def prompt(self, prefix: Sequence[int], suffix: Sequence[int]) -> list[int]:
        """The token ids of a FIM prompt (BOS, when the model wants one, is the caller's)."""
        return [self.pre, *prefix, self.suf, *suffix, self.mid]


def find_fim(token_to_id: Callable[[str], int | None]) -> FimTokens | None:
    """The model's FIM tokens by name (None: it has no prefix, suffix and middle tokens)."""
    found: dict[str, int] = {}
    for role, names in FIM_NAMES.items():
        for name in names:
            i = token_to_id(name)
            if i is not None:
                found[role] = i
                break
    if not {"pre", "suf", "mid"} <= found.keys():
        return None
    ends = tuple(dict.fromkeys(found[r] for r in ("pad", "rep", "sep") if r in found))
    return FimTokens(found["pre"], found["suf"], found["mid"], ends, found.get("rep"),
                     found.get("sep"))
