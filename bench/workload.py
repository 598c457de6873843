"""What the load generator sends and when: length distributions, tenants, arrival plans, traces.

Everything here is pure and seeded, so the same ``(spec, seed)`` gives the same requests in the same
order at the same planned times; only the server's answers differ between runs.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from pathlib import Path

import msgspec

__all__ = ["Lengths", "TenantSpec", "PlannedRequest", "TraceEntry", "load_trace", "arrivals",
           "make_prompt", "parse_tenant"]


@dataclasses.dataclass(frozen=True)
class Lengths:
    """A token count: fixed (``lo == hi``) or uniform on ``[lo, hi]``; parsed from ``"128"`` or
    ``"64:256"``. An optional ``mix`` of (probability, Lengths) pairs overrides lo/hi (``"0.8*16,0.2*512"``
    means 80 % fixed 16 and 20 % fixed 512)."""

    lo: int
    hi: int
    mix: tuple[tuple[float, Lengths], ...] = ()

    @classmethod
    def parse(cls, text: str, field: str = "length") -> Lengths:
        text = text.strip()
        try:
            if "," in text or "*" in text:
                parts: list[tuple[float, Lengths]] = []
                for item in text.split(","):
                    p, _, rest = item.partition("*")
                    parts.append((float(p), cls.parse(rest, field)))
                total = sum(p for p, _ in parts)
                if total <= 0 or any(p < 0 for p, _ in parts):
                    raise ValueError
                norm = tuple((p / total, sub) for p, sub in parts)
                return cls(min(s.lo for _, s in norm), max(s.hi for _, s in norm), norm)
            lo_s, sep, hi_s = text.partition(":")
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise ValueError(f"{field}: expected N, LO:HI or P*N,P*LO:HI..., got {text!r}") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"{field}: need 0 <= LO <= HI, got {text!r}")
        return cls(lo, hi)

    def sample(self, rng: random.Random) -> int:
        if self.mix:
            x = rng.random()
            for p, sub in self.mix:
                x -= p
                if x <= 0:
                    return sub.sample(rng)
            return self.mix[-1][1].sample(rng)
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)


@dataclasses.dataclass(frozen=True)
class TenantSpec:
    """One client population. Open loop: ``rate`` requests/s (``inf`` = all at t=0). Closed loop:
    ``concurrency`` workers each sending back-to-back. ``api_key`` None sends no Authorization."""

    name: str = "default"
    api_key: str | None = None
    rate: float | None = None
    concurrency: int | None = None
    prompt_len: Lengths = Lengths(128, 128)
    output_len: Lengths = Lengths(128, 128)
    start_s: float = 0.0  # the tenant starts sending this long after the run started
    headers: tuple[tuple[str, str], ...] = ()  # extra request headers (e.g. X-Calserve-Pool)

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError(f"tenant {self.name!r}: give exactly one of rate / concurrency")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"tenant {self.name!r}: rate must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"tenant {self.name!r}: concurrency must be >= 1")


def parse_tenant(text: str, default_prompt: Lengths, default_output: Lengths) -> TenantSpec:
    """``name:key=K,rate=R|concurrency=C,prompt=64:128,output=32,start=2`` (key optional)."""
    name, _, rest = text.partition(":")
    kw: dict[str, str] = {}
    last = None
    for item in filter(None, rest.split(",")):
        k, sep, v = item.partition("=")
        if not sep:  # a comma inside a mixture length (output=0.5*8,0.5*64) continues the value
            if last is None:
                raise ValueError(f"--tenant {text!r}: expected key=value, got {item!r}")
            kw[last] += "," + item.strip()
            continue
        last = k.strip()
        kw[last] = v.strip()
    unknown = set(kw) - {"key", "rate", "concurrency", "prompt", "output", "start"}
    if unknown:
        raise ValueError(f"--tenant {text!r}: unknown field(s) {sorted(unknown)}")
    return TenantSpec(
        name=name or "default",
        api_key=kw.get("key"),
        rate=float(kw["rate"]) if "rate" in kw else None,
        concurrency=int(kw["concurrency"]) if "concurrency" in kw else None,
        prompt_len=Lengths.parse(kw["prompt"], "prompt") if "prompt" in kw else default_prompt,
        output_len=Lengths.parse(kw["output"], "output") if "output" in kw else default_output,
        start_s=float(kw.get("start", 0.0)),
    )


class TraceEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One line of a JSONL trace. ``prompt`` is token ids or text; else ``prompt_len`` random tokens.
    ``at`` is the planned send time in seconds from the start (None = use the tenant's arrivals)."""

    prompt: list[int] | str | None = None
    prompt_len: int | None = None
    output_len: int = 128
    tenant: str = "default"
    at: float | None = None


def load_trace(path: Path) -> list[TraceEntry]:
    out: list[TraceEntry] = []
    dec = msgspec.json.Decoder(TraceEntry)
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                e = dec.decode(line)
            except msgspec.ValidationError as err:
                raise ValueError(f"{path}:{n}: {err}") from None
            if e.prompt is None and e.prompt_len is None:
                raise ValueError(f"{path}:{n}: need prompt or prompt_len")
            out.append(e)
    return out


@dataclasses.dataclass(frozen=True)
class PlannedRequest:
    index: int
    tenant: str
    at: float  # planned send time (s from run start); closed loop: 0 (sent when a worker is free)
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def arrivals(rng: random.Random, rate: float, burstiness: float = 1.0) -> Iterator[float]:
    """Inter-arrival gaps: gamma with shape ``burstiness`` and mean ``1/rate`` (1.0 = Poisson; < 1 is
    burstier, > 1 smoother), exactly as vLLM's ``bench serve --burstiness``."""
    if math.isinf(rate):
        while True:
            yield 0.0
    theta = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, theta)


def make_prompt(rng: random.Random, n: int, mode: str, vocab: tuple[int, int]) -> list[int] | str:
    """``n`` random token ids in ``[vocab[0], vocab[1])`` (mode ``ids``) or ~``n`` tokens of random
    lowercase words (mode ``text``, for servers that do not accept token-id prompts)."""
    if mode == "ids":
        lo, hi = vocab
        return [rng.randrange(lo, hi) for _ in range(n)]
    words = ("the", "of", "cat", "sun", "blue", "river", "stone", "light", "calm", "fast")
    return " ".join(rng.choice(words) for _ in range(max(1, n)))
