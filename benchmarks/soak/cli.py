"""The command line: ``python -m benchmarks.soak --help``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.server_processes import ServerWatch
from hotwire_api.keys import Role, add_key
from hotwire_api.server_process import ServerExited

from . import __doc__ as ABOUT
from .calibration import CalibrationError
from .plan import SoakConfig
from .report import examples_text, table
from .run import run_soak
from .server import log_tail, own_server
from .tenants import run_tenant_soak, tenants_table


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=ABOUT,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    d = SoakConfig()
    parser.add_argument("--url", action="append", dest="urls",
                        help="drive this running server instead of starting one (needs --model); repeat it for "
                             "each replica of a fleet on one registry")  # fmt: skip
    parser.add_argument("--model", type=Path, help="HF folder with safetensors weights (default: build the tiny model)")
    parser.add_argument("--workdir", type=Path, help="for the built model and the server log (default: a temp folder)")
    parser.add_argument("--slots", type=int, default=16, help="HOTWIRE_SLOTS of a server the soak starts")
    parser.add_argument("--server-arg", action="append", default=[], help="extra vllm serve argument (repeatable)")
    parser.add_argument("--clients", type=int, default=d.clients)
    parser.add_argument("--client-processes", type=int, default=d.client_processes,
                        help="processes the clients run in (default: one per 64 clients)")  # fmt: skip
    parser.add_argument("--duration", type=float, default=d.duration, help="seconds of traffic")
    parser.add_argument("--ids", type=int, default=d.ids, help="vector ids in all")
    parser.add_argument("--churned", type=int, default=d.churned, help="of them churned: half replaced, half deleted")
    parser.add_argument("--pool", type=int, default=d.pool, help="markers per churned id (>= 2)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--replace-every", type=float, default=d.replace_every, help="seconds between replacements")
    parser.add_argument("--delete-every", type=float, default=d.delete_every, help="seconds between delete + register")
    parser.add_argument("--absent-for", type=float, default=d.absent_for, help="seconds a deleted id stays away")
    parser.add_argument("--churn-share", type=float, default=d.churn_share,
                        help="share of steered picks on churned ids")  # fmt: skip
    parser.add_argument("--mix", choices=("all", "plain", "steered"), default=d.mix)
    parser.add_argument("--strength", type=float, help="steering norm (default: calibrated)")
    parser.add_argument("--poll-every", type=float, default=d.poll_every, help="seconds between control-plane polls")
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout)
    parser.add_argument("--api-key", default=os.environ.get("HOTWIRE_API_KEY"))
    parser.add_argument("--id-prefix", default=d.id_prefix)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--keep-vectors", action="store_true", help="leave the soak's vectors registered")
    parser.add_argument("--out", type=Path, default=Path("soak.json"))
    parser.add_argument("--no-fail-exit", action="store_true", help="exit 0 whatever the failure counts")
    parser.add_argument("--tenants", type=int, default=0, help="that many tenants, each with every id and its own "
                        "key (soak.tenants; a server of the soak's own gets a keys file)")
    parser.add_argument("--flood", action="store_true", help="with --tenants: one more tenant flooding distinct vectors")
    parser.add_argument("--flood-windows", type=float, default=0.0, metavar="SECONDS",
                        help="with --flood: flood in every other window of that many seconds, the first one quiet, and "
                             "report the other tenants' latencies and requests per second in each kind of window")
    parser.add_argument("--tenant-rows", type=int, help="HOTWIRE_TENANT_ROWS of a server the soak starts")
    parser.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                        help="py-spy the server the soak starts (API server, engine core) for that long in the middle "
                             "of the traffic, into <--out without .json>.<process>.txt (py-spy beside python or on PATH)")
    args = parser.parse_args(argv)
    if args.flood and not args.tenants:
        parser.error("--flood needs --tenants")
    if args.flood_windows and not args.flood:
        parser.error("--flood-windows needs --flood")
    if args.flood_windows and args.duration < 2 * args.flood_windows:
        parser.error("--flood-windows needs a --duration of at least two windows")
    if args.tenants and args.urls and len(args.urls) > 1:
        parser.error("--tenants runs on one server")
    if args.urls and args.profile:
        parser.error("--profile profiles a server the soak starts, not one at --url")
    if args.urls and not args.model:
        parser.error("--url needs --model: the markers come from the served model's LM head weights")
    if args.pool < 2 and args.churned:
        parser.error("--pool must be at least 2: consecutive versions need different markers")
    return args


def config_of(args: argparse.Namespace) -> SoakConfig:
    names = SoakConfig.__dataclass_fields__
    return SoakConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_of(args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hotwire-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    built = args.model is None
    if built:
        from hotwire_core.tiny_model import build_model

        args.model = build_model(workdir / "tiny", "tiny", weights=True)
    log: Path | None = None
    try:
        with contextlib.ExitStack() as stack:
            urls, env, watch = args.urls, {}, None
            if not urls and config.tenants:  # an operator key to make the tenants' keys with
                env = {"HOTWIRE_KEYS_FILE": str(workdir / "keys.json"), "HOTWIRE_TENANT_REGISTRATIONS_PER_MIN": "1000000",
                       **({"HOTWIRE_TENANT_ROWS": str(args.tenant_rows)} if args.tenant_rows else {})}
                (workdir / "keys.json").unlink(missing_ok=True)  # the soak's own: a fresh one each run
                config.api_key = add_key(workdir / "keys.json", "soak-operator", Role.ADMIN)
            if not urls:
                server = stack.enter_context(own_server(args.model, args.slots, args.server_arg, workdir, built, env))
                urls, log = [server.url], server.log
                watch = ServerWatch(server.pid, args.profile, args.out.with_suffix(""))
            if config.tenants:
                result = asyncio.run(run_tenant_soak(config, urls[0], args.model, watch))
            else:
                result = asyncio.run(run_soak(config, urls, args.model, watch))
    except (CalibrationError, ServerExited) as exc:
        print(f"soak: {type(exc).__name__}: {exc}\n{log_tail(log or workdir / 'server.log')}", file=sys.stderr)
        return 2
    result["server_log"] = str(log) if log else None
    args.out.write_text(json.dumps(result, indent=1))
    print(tenants_table(result) if config.tenants else table(result))
    if config.tenants:
        for tenant, part in result["tenants"].items():
            if part["failed"]:
                print(f"soak: {tenant}'s failures (examples):\n{examples_text(part)}")
        return 1 if result["failed"] and not args.no_fail_exit else 0
    if result["failed"]:
        print("soak: failures (examples):\n" + examples_text(result))
        if log is not None:
            print(f"soak: last lines of the server log {log}:\n{log_tail(log)}")
    print(f"soak: report {args.out}" + (f", server log {log}" if log else ""))
    return 1 if result["failed"] and not args.no_fail_exit else 0
