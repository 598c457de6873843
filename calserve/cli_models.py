"""``calserve models list|load|unload|rollback``: a client of a running server's admin API.

::

    calserve models list     [--url URL] [--token TOKEN] [--json]
    calserve models load     ALIAS PACKAGE [--drain-timeout S]   # PACKAGE relative to trust.model_root
    calserve models unload   ALIAS [--drain-timeout S]
    calserve models rollback ALIAS [--drain-timeout S]

``--url`` defaults to ``http://127.0.0.1:8000``, ``--token`` to the environment variable
``CALSERVE_ADMIN_TOKEN``. Exit status 0 on success, 1 when the server refused (its error message and
``code`` are printed) or could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["add_models_parser", "run_models"]

_ENV_TOKEN = "CALSERVE_ADMIN_TOKEN"


def add_models_parser(sub: Any) -> None:
    m = sub.add_parser("models", help="list/load/unload/roll back models of a running server")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server (default %(default)s)")
    common.add_argument("--token", default=None, help=f"admin token (default: ${_ENV_TOKEN})")
    common.add_argument("--timeout", type=float, default=300.0, help="HTTP timeout in seconds")
    ops = m.add_subparsers(dest="op", required=True)
    ls = ops.add_parser("list", help="aliases, their generations and states", parents=[common])
    ls.add_argument("--json", action="store_true", help="the raw JSON answer")
    ld = ops.add_parser("load", help="load PACKAGE as ALIAS (a new alias, or a hot replacement)",
                        parents=[common])
    ld.add_argument("alias")
    ld.add_argument("package", help="package path relative to the server's trust.model_root")
    for name, text in (("unload", "drain and unload ALIAS"),
                       ("rollback", "re-publish ALIAS's previous package")):
        p = ops.add_parser(name, help=text, parents=[common])
        p.add_argument("alias")
    for p in (ld, *[ops.choices[n] for n in ("unload", "rollback")]):
        p.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                       help="drain deadline of the generation being replaced/unloaded (default 30)")


def _print_list(body: dict[str, Any]) -> None:
    rows = [("ALIAS", "GEN", "STATE", "PREVIOUS", "SHA256", "PACKAGE", "GENERATIONS")]
    for e in body.get("models", []):
        gens = ", ".join(f"g{g['id']}:{g['state']}({g['active_requests']} req)"
                         for g in e.get("generations", []))
        prev = e.get("previous")
        rows.append((e["alias"], str(e["generation"]), e["state"],
                     "-" if prev is None else str(prev), (e.get("sha256") or "")[:12],
                     e.get("package", ""), gens))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


def run_models(a: argparse.Namespace) -> int:
    import httpx

    token = a.token if a.token is not None else os.environ.get(_ENV_TOKEN, "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = a.url.rstrip("/") + "/admin/v1/models"
    body: dict[str, Any] = {}
    if getattr(a, "drain_timeout", None) is not None:
        body["drain_timeout_s"] = a.drain_timeout
    try:
        with httpx.Client(timeout=a.timeout, headers=headers) as c:
            if a.op == "list":
                r = c.get(base)
            elif a.op == "load":
                r = c.post(f"{base}/{a.alias}/load", json={"package": a.package, **body})
            else:
                r = c.post(f"{base}/{a.alias}/{a.op}", json=body)
    except httpx.HTTPError as e:
        print(f"calserve models {a.op}: cannot reach {a.url}: {e}", file=sys.stderr)
        return 1
    try:
        data = r.json()
    except ValueError:
        data = {"error": {"message": r.text[:200], "code": None}}
    if r.status_code != 200:
        err = data.get("error", {}) if isinstance(data, dict) else {}
        print(f"calserve models {a.op}: {r.status_code} {err.get('code')}: {err.get('message')}",
              file=sys.stderr)
        return 1
    if a.op == "list" and not a.json:
        _print_list(data)
    else:
        print(json.dumps(data, indent=2))
    return 0
