"""The ``calserve`` command line: pack / keygen / verify / device-check / serve.

Expected refusals (a bad package, a bad config, a missing file) print one line to stderr and exit 1;
usage errors exit 2 (argparse); no tracebacks for either.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from calserve import __version__
from calserve.errors import CalserveError

__all__ = ["main", "build_parser"]


def _profiles(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--profiles: {text!r} is not a comma list of integers") from None
    if not out or any(b not in (1, 4, 8, 16) for b in out):
        raise argparse.ArgumentTypeError(f"--profiles: each must be one of 1, 4, 8, 16 (got {text!r})")
    return sorted(set(out))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="calserve", description="Calculet NPU LLM server tools")
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    ap.add_argument("--version", action="version", version=f"calserve {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pack", help="build a signed calculet-calbin/v1 package")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR",
                     help="Hugging Face Qwen3/Llama/Qwen2/Gemma 3 checkpoint directory")
    src.add_argument("--from-gguf", metavar="FILE",
                     help="GGUF file (llama, qwen2, qwen3, phi3 or gemma3; quantized ok)")
    src.add_argument("--demo", action="store_true", help="the built-in demo model")
    p.add_argument("--out", required=True, metavar="PKG", help="package directory to create")
    p.add_argument("--key", metavar="KEY", help="ed25519 private key (default: the development key)")
    p.add_argument("--profiles", type=_profiles, default=[1, 4, 8, 16], help="e.g. 1,4,8,16")
    p.add_argument("--timing", default="none", help="timing profile: none|fast|qwen3-dual|sat-4k")
    p.add_argument("--max-seq", type=int, default=2048, help="max_seq of every profile (--from-hf/gguf)")
    p.add_argument("--max-sequences", type=int, default=None, help="KV sequences per profile")
    p.add_argument("--kv-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--dtype", choices=["F32", "BF16"], default="F32",
                   help="stored weights of --from-gguf (dequantized; default F32)")
    p.add_argument("--force", action="store_true", help="replace an existing package at --out")

    k = sub.add_parser("keygen", help="write an ed25519 key pair KEY and KEY.pub")
    k.add_argument("--out", required=True, metavar="KEY")

    v = sub.add_parser("verify", help="check a package's signature, hashes and static validity")
    v.add_argument("package", metavar="PKG")
    v.add_argument("--trusted-key", action="append", default=[], metavar="PUB")
    v.add_argument("--config", metavar="FILE", help="config file (default: CALSERVE_CONFIG/defaults)")
    v.add_argument("--runtime", choices=["calrt-0.7.6", "sim-next"], default=None)

    d = sub.add_parser("device-check", help="run the spec §18 integration matrix on the runtime")
    d.add_argument("package", metavar="PKG")
    d.add_argument("--trusted-key", action="append", default=[], metavar="PUB")
    d.add_argument("--config", metavar="FILE")
    d.add_argument("--runtime", choices=["calrt-0.7.6", "sim-next"], default=None)
    d.add_argument("--soak", type=int, default=10, metavar="N", help="load/unload cycles")

    from calserve.cli_models import add_models_parser  # the admin API client (issue 14)

    add_models_parser(sub)

    s = sub.add_parser("serve", help="run the HTTP server (see `calserve serve --help`)", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    c = sub.add_parser("cluster", help="N replicas (one per board) behind HAProxy (see `calserve "
                       "cluster --help`)", add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


def _cmd_pack(a: argparse.Namespace) -> int:
    from calserve.models.pack import pack_demo, pack_from_hf
    from calserve.models.signing import dev_key

    key = Path(a.key) if a.key else dev_key()
    if a.demo:
        out = pack_demo(a.out, key, a.profiles, a.timing, replace=a.force)
    elif a.from_gguf:
        from calserve.models.gguf_import import pack_from_gguf

        out = pack_from_gguf(
            a.from_gguf, a.out, key, a.profiles, a.timing, max_seq=a.max_seq,
            max_sequences=a.max_sequences, kv_dtype=a.kv_dtype, weights_dtype=a.dtype,
            replace=a.force,
        )
    else:
        out = pack_from_hf(
            a.from_hf,
            a.out,
            key,
            a.profiles,
            a.timing,
            max_seq=a.max_seq,
            max_sequences=a.max_sequences,
            kv_dtype=a.kv_dtype,
            replace=a.force,
        )
    print(f"packed {out} (signed with {key})")
    return 0


def _cmd_keygen(a: argparse.Namespace) -> int:
    from calserve.models.signing import generate_keypair

    if Path(a.out).exists():
        raise CalserveError(f"{a.out}: already exists; refusing to overwrite a key")
    priv, pub = generate_keypair(a.out)
    print(f"wrote {priv} and {pub}")
    return 0


def _open_cli_package(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    from calserve.config import calserve_home, load_config
    from calserve.models.package import open_package
    from calserve.models.signing import TrustStore

    cfg = load_config(a.config)
    trust = TrustStore.from_config(cfg.trust, a.trusted_key)
    root = Path(cfg.trust.model_root) if cfg.trust.model_root else calserve_home() / "models"
    # A package typed on the command line is trusted as a location; its signature is still checked.
    return cfg, open_package(a.package, trust, root, allow_outside_root=True)


def _cmd_verify(a: argparse.Namespace) -> int:
    from calserve.models.validate import runnable_profiles
    from calserve.runtime.types import RUNTIME_PROFILES

    cfg, vp = _open_cli_package(a)
    m = vp.manifest
    caps = RUNTIME_PROFILES[a.runtime or cfg.runtime.profile]
    run = runnable_profiles(m, caps)
    print(f"OK {vp.path}")
    print(f"  name       {m.name}  ({m.model.num_hidden_layers} layers, hidden {m.model.hidden_size},"
          f" vocab {m.model.vocab_size})")
    print(f"  sha256     {vp.sha256}")
    print(f"  signer     {vp.signer}")
    print("  profiles   " + ", ".join(
        f"B{b} ({m.profile(b).tier}, {'runnable' if ok else 'unavailable'} on {caps.name})"
        for b, ok in run.items()
    ))
    print(f"  timing     {m.timing.name}")
    return 0


def _cmd_device_check(a: argparse.Namespace) -> int:
    from calserve.models.devicecheck import print_table, run_device_check

    cfg, vp = _open_cli_package(a)
    rows = run_device_check(vp, a.runtime or cfg.runtime.profile, soak_cycles=a.soak)
    print_table(rows, sys.stdout)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def _cmd_models(a: argparse.Namespace) -> int:
    from calserve.cli_models import run_models

    return run_models(a)


def _cmd_serve(rest: Sequence[str]) -> int:
    from calserve.api import serve

    return int(serve.main(list(rest)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":
        return _cmd_serve(args[1:])
    if args and args[0] == "cluster":
        from calserve import cluster

        return cluster.main(args[1:])
    a = build_parser().parse_args(args)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr)
    handlers = {
        "pack": _cmd_pack,
        "keygen": _cmd_keygen,
        "verify": _cmd_verify,
        "device-check": _cmd_device_check,
        "models": _cmd_models,
    }
    try:
        return handlers[a.cmd](a)
    except CalserveError as e:
        print(f"calserve {a.cmd}: error: {e.message}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"calserve {a.cmd}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
