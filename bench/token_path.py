"""Micro-benchmark of the per-token serving path inside one process, without HTTP or device.

``python -m bench.token_path [--inbox channel|inline] [--steps 256] [--reps 5] [--tokens-per-event K] [--run]``

A dispatcher-like producer delivers one ``Tokens`` message per stream per decode step (64 streams,
B16 batches, a checkpoint after each batch, like the executor), each to a real request actor
(:func:`calserve.engine.actor.run_actor`) whose :class:`~calserve.engine.stream.StreamWriter` is read
by the real SSE pump (:func:`calserve.api.running.pump_stream` with its :class:`~calserve.api.stream_encoder.StreamEncoder`, with metrics) and a fake
ASGI ``send`` (one checkpoint, as hypercorn's socket write). Token ids are random ids of the demo
tokenizer (like null compute). Prints server CPU µs per token (process time, producer loop
subtracted; min over ``--reps``).

On a shared 2-core machine wall/CPU times are noisy; instruction counts are not. Under valgrind the
difference between two step counts is the instructions per token of this path, e.g.::

    for s in 64 128; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m bench.token_path --steps $s --reps 1 2>&1 | grep Collected; done
    # (Ir(128) - Ir(64)) / (64 * 64) = instructions per token

``--inbox inline`` uses :func:`calserve.engine.actor.open_actor_inbox` (the actor's token step runs
in the sender's call) instead of a trio memory channel: what the registry hook would give.
``--tokens-per-event K`` gives each stream K tokens between two reads of its consumer (the grouping
the server's streams have under load, ~4-5 in ``http-floor``): the per-event work is then shared.
``--run`` sends those K tokens as one ``TokenRun`` (what a K-step job of multi-step decode gives a
lane: one actor step, one detokenizer call and one stream write for all of them) instead of K
``Tokens`` messages. ``--hold sleep|timer`` holds each stream 1 µs after every event, as the pacer does while the server
groups: by ``trio.sleep_until`` or by the app's :class:`~calserve.api.pacing.HoldTimer`.
"""

from __future__ import annotations

import argparse
import random
import time
import types
from pathlib import Path
from typing import Any

import trio
import trio.testing

__all__ = ["main"]

STREAMS, BATCH = 64, 16


def _tokenizer() -> Any:
    import tokenizers

    from calserve.models.demo import demo_tokenizer_json
    from calserve.models.tokenizer import Tokenizer

    return Tokenizer(tokenizers.Tokenizer.from_str(demo_tokenizer_json()), eos_token_ids=[0])


async def _run(tok: Any, steps: int, inline: bool, group: int = 1, hold: str = "none",
               runs: bool = False) -> tuple[float, int]:
    """(process CPU seconds of the run, tokens the stream writers took)."""
    from calserve.api.convert import Prepared
    from calserve.api.metrics import ApiMetrics
    from calserve.api.render import LogprobFormatter
    from calserve.engine.actor import open_actor_inbox, run_actor
    from calserve.engine.state import Admitted, End, TokenRun, Tokens
    from calserve.engine.stream import StreamWriter
    from calserve.engine.types import FinishReason, GenerateRequest

    metrics = ApiMetrics(lambda: None)
    prep = Prepared(kind="completion", alias="qwen3", request=GenerateRequest((1,)), stream=True,
                    include_usage=False, echo_text="", logprobs=None)
    vocab = tok.backend.get_vocab_size(with_added_tokens=True)

    class Registry:  # the actor's sink (calserve.engine.actor.ActorSink)
        def stop(self, seq: object, reason: object) -> None:
            pass

        def done(self, seq: object, outcome: str) -> None:
            pass

    class Handle:  # calserve.api.protocol.HandleLike over one StreamWriter
        request_id = 1

        def __init__(self, w: StreamWriter) -> None:
            self.receive_many = w.receive_many
            self._w = w

        def events(self) -> Any:
            return self._w.__aiter__()

        def cancel(self) -> None:
            pass

        async def aclose(self) -> None:
            await self._w.aclose()

    from calserve.api.running import RequestLease, pump_stream
    from calserve.api.stream_encoder import StreamEncoder

    async def asgi_send(message: dict[str, Any]) -> None:
        await trio.lowlevel.checkpoint()  # the socket write

    from calserve.api.pacing import HoldTimer, StreamPacer

    # --hold: every event is followed by a hold of 1 µs (it ends at the next scheduling round, so
    # the grouping is the producer's as without one), waited out by the HoldTimer or (not started)
    # by trio.sleep_until: what each costs per event
    timer = HoldTimer()
    pacer = StreamPacer(fixed_s=1e-6, timer=timer) if hold != "none" else None

    async def consume(w: StreamWriter) -> None:
        lease = RequestLease(Handle(w))
        enc = StreamEncoder.for_request(prep, LogprobFormatter(tok))
        await pump_stream(lease, enc, asgi_send, metrics, prep, pacer)

    rng = random.Random(0)
    async with trio.open_nursery() as nursery:
        if hold == "timer":
            await nursery.start(timer.run)
        inboxes: list[Any] = []
        writers: list[StreamWriter] = []
        for _ in range(STREAMS):
            send, recv = open_actor_inbox() if inline else trio.open_memory_channel[Any](float("inf"))
            w = StreamWriter(1)
            writers.append(w)
            sp = types.SimpleNamespace(stop=(), min_tokens=0, skip_special_tokens=True,
                                       include_stop_str=False)
            seq = types.SimpleNamespace(req=types.SimpleNamespace(sampling=sp), prompt=[1] * 16,
                                        arrival=0.0, admitted_at=0.0, first_token_at=0.0)
            nursery.start_soon(run_actor, seq, recv, w, tok, Registry())  # type: ignore[arg-type]
            nursery.start_soon(consume, w)
            send.send_nowait(Admitted(0.0))
            inboxes.append(send)
        await trio.testing.wait_all_tasks_blocked()
        t0 = time.process_time()
        for step in range(0, steps, group):
            for b in range(STREAMS // BATCH):
                if runs:  # the same ids in the same draw order, a stream's as one message
                    ids = _draw(rng, vocab, step, min(steps, step + group))
                    for i in range(b * BATCH, (b + 1) * BATCH):
                        inboxes[i].send_nowait(TokenRun(ids[i - b * BATCH], step == 0))
                else:
                    for k in range(step, min(steps, step + group)):  # ``group`` tokens per read
                        for i in range(b * BATCH, (b + 1) * BATCH):
                            inboxes[i].send_nowait(Tokens(rng.randrange(10, vocab), None, k == 0))
                await trio.lowlevel.checkpoint()
                await trio.lowlevel.checkpoint()
        for s in inboxes:
            s.send_nowait(End(FinishReason.LENGTH))
        await trio.testing.wait_all_tasks_blocked()
        timer.stop()
        return time.process_time() - t0, sum(w.statistics().tokens_put for w in writers)


def _draw(rng: random.Random, vocab: int, k0: int, k1: int) -> list[list[int]]:
    """One batch's tokens for steps ``[k0, k1)``, a list per stream, drawn step by step."""
    ids: list[list[int]] = [[] for _ in range(BATCH)]
    for _ in range(k0, k1):
        for lane in ids:
            lane.append(rng.randrange(10, vocab))
    return ids


async def _producer_only(steps: int, vocab: int, group: int = 1, runs: bool = False) -> float:
    from calserve.engine.state import TokenRun, Tokens

    rng = random.Random(0)
    t0 = time.process_time()
    for step in range(0, steps, group):
        for _ in range(STREAMS // BATCH):
            if runs:
                for lane in _draw(rng, vocab, step, min(steps, step + group)):
                    TokenRun(lane, step == 0)
            else:
                for k in range(step, min(steps, step + group)):
                    for _ in range(BATCH):
                        Tokens(rng.randrange(10, vocab), None, k == 0)
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.token_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inbox", choices=("channel", "inline"), default="channel")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens-per-event", type=int, default=1,
                    help="tokens each stream gets between two reads of its consumer (as the "
                         "server's stream grouping gives under load; 1: one event per token)")
    ap.add_argument("--run", action="store_true",
                    help="send those tokens as one TokenRun (a multi-step job's lane), not one "
                         "Tokens message each")
    ap.add_argument("--hold", choices=("none", "sleep", "timer"), default="none",
                    help="hold each stream 1 µs after every event, by trio.sleep_until (sleep) or "
                         "the server's HoldTimer (timer): the pacing's cost per event")
    a = ap.parse_args(argv)
    tok = _tokenizer()
    vocab = tok.backend.get_vocab_size(with_added_tokens=True)
    best = float("inf")
    for _ in range(a.reps):
        g = max(1, a.tokens_per_event)
        dt, _ = trio.run(_run, tok, a.steps, a.inbox == "inline", g, a.hold, a.run)
        base = trio.run(_producer_only, a.steps, vocab, g, a.run)
        best = min(best, (dt - base) / (STREAMS * a.steps) * 1e6)
    print(f"{Path(__file__).stem} inbox={a.inbox} tokens/event={a.tokens_per_event}"
          f"{' as one TokenRun' if a.run else ''} hold={a.hold}: "
          f"{best:.2f} µs CPU per token "
          f"(actor + StreamWriter + pump_stream + metrics; {STREAMS} streams, B{BATCH})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
