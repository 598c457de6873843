"""The HTTP app in-process on the REAL engine (``calserve.engine.engine.Engine``) over the trio-native
``FakeBackend``: device faults can be injected and the fake clock (``autojump_clock``) is safe.

Used by the tests that drive spec §16 metric families whose condition needs the real scheduler,
executor and recovery (faults, resets, quarantine, queues by class, tenant lag)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from calserve.api.app import CalserveApp, create_app, get_state
from calserve.config import CalserveConfig
from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend
from calserve.models.source import ModelSource
from calserve.runtime.reference import ModelConfig
from calserve.runtime.types import ProfileSpec, Timing

from .conftest import Harness, engine_opened

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class ChatCharTokenizer:
    """Like the engine tests' one-char-per-token tokenizer (ids < 90 are printable ASCII, above
    that CJK), plus what the HTTP layer needs: a chat template, and an ``encode`` that maps every
    character into the fake vocabulary."""

    eos_token_ids: tuple[int, ...] = ()
    vocab_size = 128

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(33 + i) if i < 90 else chr(0x4E00 + i) for i in ids)

    def encode(self, text: str) -> list[int]:
        return [(ord(c) - 33) % 90 for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        s = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


def api_source(*, profiles: Sequence[int] = (1, 4, 8), max_seq: int = 256,
               max_sequences: int = 16, step_us: float = 1000.0, alias: str = "qwen3",
               tokenizer: Any = None, prefill_base_us: float = 200.0,
               vocab_size: int = 128) -> ModelSource:
    """An in-memory model for the FakeBackend (as ``tests/engine/helpers.fake_source``)."""
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    return ModelSource(
        alias=alias, model_config=cfg, weights={},
        profiles={b: ProfileSpec(b, max_seq, max_sequences) for b in profiles},
        eos_token_ids=(), tokenizer=tokenizer or ChatCharTokenizer(), sha256="0" * 64,
        timing={b: Timing(prefill_base_us, 2.0, {b: step_us}) for b in profiles})


class RealHarness(Harness):
    def __init__(self, app: CalserveApp, client: Any, backend: FakeBackend) -> None:
        super().__init__(app, client)
        self.backend = backend

    @property
    def real_engine(self) -> Engine:
        host = get_state(self.app).host
        assert host is not None and host.engine is not None
        assert isinstance(host.engine, Engine)
        return host.engine

    async def metrics(self) -> Samples:
        r = await self.client.get("/metrics")
        assert r.status_code == 200
        return parse_metrics((await r.get_data()).decode())


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: Samples, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def total(m: Samples, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


def labels_of(m: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(k)[label]: v for (n, k), v in m.items() if n == name and label in dict(k)}


@contextlib.asynccontextmanager
async def real_app(config: CalserveConfig, *, sources: Sequence[ModelSource] | None = None,
                   seed: int = 2) -> AsyncIterator[RealHarness]:
    backend = FakeBackend("sim-next", seed=seed)
    srcs = {s.alias: s for s in (sources or [api_source()])}

    def factory(cfg: CalserveConfig) -> Any:
        return Engine.open(cfg, backend=backend, sources=srcs)

    app = create_app(config, engine_factory=factory)
    async with app.test_app() as t:
        await engine_opened(app)
        yield RealHarness(app, t.test_client(), backend)
