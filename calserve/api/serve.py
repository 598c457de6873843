"""``calserve serve``: run the HTTP server on hypercorn's trio worker, in this process.

Why not just ``hypercorn -k trio calserve:app``: hypercorn's CLI exits 0 even when its worker died, so a
supervisor cannot tell a crash from a clean stop. Here we drive ``hypercorn.trio.serve`` ourselves and
exit non-zero when the engine fails beyond recovery (or never started), 0 on SIGINT/SIGTERM.

Exit codes: 0 clean shutdown; 1 engine failed / start-up refused / bad config / the device could
not be released cleanly; 2 usage.

SIGTERM/SIGINT drains (``server.drain_timeout_s``, :mod:`calserve.engine.drain`): ``/ready`` turns
503 (``reason: draining``) at once so a load balancer takes the instance out of rotation, the
listener stays open and new generation requests get 503 + Retry-After, admitted requests finish
within the drain timeout, the rest end with an error event, every submitted job drains; then the
listener closes, connections get ``_FLUSH_S`` to write what they hold, and the engine is closed. A
second signal ends the wait for admitted requests early; the job drain is never skipped.

Connections go through :mod:`calserve.api.listener` (hypercorn's trio worker with calserve's
connection guard: keep-alive, header timeout and connection cap from ``server.``, hypercorn's own
error answers in the OpenAI shape) — what the hypercorn CLI cannot give.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any
from pathlib import Path

import msgspec
import trio

from calserve import __version__
from calserve.api.logs import ACCESS_LOG_FORMAT, configure_logging
from calserve.config import CalserveConfig, ModelEntry, decode_config, load_config
from calserve.errors import CalserveError

__all__ = ["main", "build_parser", "apply_cli", "serve_app"]

log = logging.getLogger("calserve.serve")

#: After the drain: how long open connections may still write their last bytes (every request has
#: its terminal event by then) before hypercorn cuts them.
_FLUSH_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="calserve serve",
                                 description="Run the OpenAI-compatible HTTP server (trio).")
    ap.add_argument("--config", metavar="FILE",
                    help="config file (default: $CALSERVE_CONFIG, else the embedded default)")
    ap.add_argument("--model", metavar="PKG",
                    help="serve this package as the default (and only) alias; its location is "
                         "trusted, its signature is still checked")
    ap.add_argument("--alias", metavar="NAME",
                    help="alias for --model (default: the package directory's name)")
    ap.add_argument("--trusted-key", action="append", default=[], metavar="PUB",
                    help="trust this ed25519 public key (repeatable)")
    ap.add_argument("--host", help="listen address (default: server.host, 127.0.0.1)")
    ap.add_argument("--port", type=int, help="listen port (default: server.port, 8000)")
    ap.add_argument("--device", type=int, metavar="N",
                    help="board index to open (default: runtime.device, 0); one process per board")
    ap.add_argument("--version", action="version", version=f"calserve {__version__}")
    ap.add_argument("--log-level", default="info",
                    choices=["debug", "info", "warning", "error"])
    ap.add_argument("--access-log", action="store_true", help="log every request to stderr")
    ap.add_argument("--log-format", choices=["text", "json"], default=None,
                    help="text lines or one JSON object per line (default: server.log_format)")
    return ap


def apply_cli(config: CalserveConfig, a: argparse.Namespace) -> CalserveConfig:
    """Fold the command-line overrides into the config (re-validated)."""
    data = msgspec.to_builtins(config)
    if a.model:
        pkg = Path(a.model).expanduser().resolve()
        alias = a.alias or pkg.name
        data["models"] = {alias: msgspec.to_builtins(ModelEntry(package=str(pkg)))}
        data["scheduler"]["model_alias"] = alias
        # "trusted as a location": the package's own directory becomes the model root.
        data["trust"]["model_root"] = str(pkg.parent)
    elif a.alias:
        raise CalserveError("--alias needs --model")
    data["trust"]["trusted_keys"] = list(data["trust"]["trusted_keys"]) + [
        str(Path(k).expanduser().resolve()) for k in a.trusted_key
    ]
    if a.host is not None:
        data["server"]["host"] = a.host
    if a.port is not None:
        data["server"]["port"] = a.port
    if getattr(a, "device", None) is not None:
        data["runtime"]["device"] = a.device
    try:
        return decode_config(data, "command line")
    except ValueError as e:  # __post_init__ cross-checks
        raise CalserveError(f"command line: {e}") from None


async def serve_app(
    a: argparse.Namespace, config: CalserveConfig, *, engine_factory: Any = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Serve until SIGINT/SIGTERM (-> 0) or an engine failure (-> 1). ``task_status`` reports the
    bound addresses (tests bind port 0)."""
    from hypercorn.config import Config as HyperConfig

    from calserve.api.app import create_app, get_state
    from calserve.api.listener import serve_guarded

    app = create_app(config, engine_factory=engine_factory)
    state = get_state(app)
    hc = HyperConfig()
    host = config.server.host
    hc.bind = [f"[{host}]:{config.server.port}" if ":" in host else f"{host}:{config.server.port}"]
    # Logger objects, not "-": hypercorn would add its own stderr handler next to basicConfig's.
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.accesslog = logging.getLogger("hypercorn.access") if a.access_log else None
    hc.access_log_format = ACCESS_LOG_FORMAT
    hc.loglevel = a.log_level.upper()
    hc.graceful_timeout = _FLUSH_S
    outcome = {"failed": False}

    async def shutdown_trigger() -> None:
        async with trio.open_nursery() as n:
            hurry = trio.Event()

            async def drain() -> None:
                host = state.host
                if host is not None:
                    await host.drain(config.server.drain_timeout_s, hurry)
                n.cancel_scope.cancel()

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
                    draining = False
                    async for s in sigs:
                        name = signal.Signals(s).name
                        if not draining:
                            draining = True
                            log.info("received %s: draining (server.drain_timeout_s %g s; a second "
                                     "signal shortens the wait)", name, config.server.drain_timeout_s)
                            n.start_soon(drain)
                        elif not hurry.is_set():
                            log.warning("received %s again: ending the wait for admitted requests "
                                        "now; submitted device jobs still drain", name)
                            hurry.set()
                        else:
                            log.warning("received %s: still draining submitted device jobs", name)

            async def on_failure() -> None:
                while state.host is None:
                    await trio.sleep(0.05)
                await state.host.failed.wait()
                outcome["failed"] = True
                # The reason was logged once where it happened (the host).
                log.critical("stopping with exit code 1 (%s)",
                             "start-up failed" if state.host.start_failure is not None
                             else "the engine failed beyond recovery")
                n.cancel_scope.cancel()

            n.start_soon(on_signal)
            n.start_soon(on_failure)

    try:
        await serve_guarded(app, hc, config.server, shutdown_trigger=shutdown_trigger,
                            registry=state.metrics.registry, task_status=task_status)
    except BaseException as e:  # lifespan start-up failure and friends
        if isinstance(e, KeyboardInterrupt):
            return 0
        if isinstance(e, BaseExceptionGroup):
            _, rest = e.split(trio.Cancelled)
            if rest is None:  # only cancellation: the caller stops us (tests), not a failure
                raise
        elif isinstance(e, trio.Cancelled):
            raise
        cause = state.startup_error or e
        while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
            cause = cause.exceptions[0]
        print(f"calserve serve: could not serve: {cause}", file=sys.stderr)
        return 1
    if state.host is None:
        print("calserve serve: the engine never started", file=sys.stderr)
        return 1
    if outcome["failed"] or state.host.failed.is_set():
        return 1
    if state.host.unclean is not None:
        print(f"calserve serve: the device was not released cleanly: {state.host.unclean}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    configure_logging(a.log_level, "text")
    try:
        config = apply_cli(load_config(a.config), a)
    except CalserveError as e:
        print(f"calserve serve: {e.message}", file=sys.stderr)
        return 1
    configure_logging(a.log_level, a.log_format or config.server.log_format)
    return trio.run(serve_app, a, config)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
