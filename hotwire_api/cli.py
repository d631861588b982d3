"""The ``hotwire`` command: manage steering vectors on a running server.

    hotwire register ID FILE [--replace] [--layers 10,12]
    hotwire register ID SAE_FOLDER --feature N [--replace]
    hotwire export ID OUT [--format safetensors|gguf] [--version N]
    hotwire extract ID --jsonl FILE [--layers all|8-20|10,12] [--method mean_diff|pca] [--position last|mean]
                       [--normalize] [--replace] [--timeout S]
    hotwire complete PROMPT [--steer ID:LAYER:SCALE ... | --spec JSON] [--read ID:LAYER[:BIAS] ...]
                     [--tokens generated|prompt|all] [--max-tokens N] [--temperature T] [--model M]
    hotwire list | slots | fleet | delete ID
    hotwire monitors list | monitors add ID --probe P --layer L --threshold T [--bias B] [--flag above|below]
                     [--scope generated|prompt] [--reduce max|mean|min] [--replace] | monitors delete ID
    hotwire keys [--fleet MODEL] add NAME --role read|steer|admin [--tenant T] | keys rotate NAME | keys revoke NAME | keys list  [--file F]

Every command takes ``--url URL`` (env ``HOTWIRE_URL``, default http://localhost:8000) and ``--api-key KEY`` (env
``HOTWIRE_API_KEY``), before or after the command name.

FILE is ``.safetensors`` (one tensor, or 1-D tensors named by layer index), a control-vector ``.gguf``
(llama.cpp, repeng) or ``.json`` in the registration format; SAE_FOLDER is an SAE saved by SAELens (cfg.json,
sae_weights.safetensors), of which feature N is registered. ``export`` writes the vector to OUT (format: from OUT's
suffix unless given). ``extract`` reads contrastive examples from a JSONL file, one object per line with
``positive`` and/or ``negative`` (a prompt string or a list of chat messages; a line with both is a pair, as ``pca``
needs), and has the server compute and register the vector. ``complete`` sends one steered and/or read completion
(``POST /v1/completions``; ``--vllm-key``: vLLM's key where it is not ``--api-key``, which then goes in
``X-Hotwire-Key``). ``keys`` edits a keys file (``--file``, env ``HOTWIRE_KEYS_FILE``; no server needed), or with
``--fleet MODEL`` the fleet's keys in the Redis of ``HOTWIRE_REGISTRY``: ``add`` and ``rotate`` print the new key, the
only time it is shown. Results print as JSON; errors print to stderr (exit 1 for
a refusal, an unreachable server or an answer this client cannot read; 2 for local errors such as a bad file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import httpx
import pydantic

from hotwire_api.client import DEFAULT_URL, HotwireClient
from hotwire_api.codec import parse_layer_list
from hotwire_api.completion import parse_probe, parse_steering
from hotwire_api.errors import HotwireError
from hotwire_api.fleet.config import FleetConfig, Keys, registry_url
from hotwire_api.fleet.key_ring import FleetKeys
from hotwire_api.fleet.redis_registry import RedisRegistry
from hotwire_api.keys import Role, add_key, read_keys, revoke_key, rotate_key
from hotwire_api.settings import API_KEY


def _layers(value: str) -> list[int]:
    """``--layers``: the syntax the HTTP API's form field takes (codec.parse_layer_list)."""
    try:
        layers = parse_layer_list(value, "--layers")
    except HotwireError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if layers is None:
        raise argparse.ArgumentTypeError("expected layer indices like 10,12, got nothing")
    return list(layers)


def _argument(parse):
    """An argparse type from a parser that raises ValueError: its message, not argparse's "invalid value"."""
    def parsed(value: str):
        try:
            return parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parsed


def read_examples(path: str) -> tuple[list, list]:
    """``(positive, negative)`` from a JSONL file: per line an object with ``positive`` and/or ``negative``."""
    positive, negative = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(item, dict) or not ({"positive", "negative"} & item.keys()):
                raise ValueError(f"{path}:{number}: expected an object with positive and/or negative")
            if "positive" in item:
                positive.append(item["positive"])
            if "negative" in item:
                negative.append(item["negative"])
    return positive, negative


def _server_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """``--url`` / ``--api-key``: on the main parser with their defaults, and on every command without any (a
    default there would overwrite what was given before the command name)."""
    url = os.environ.get("HOTWIRE_URL", DEFAULT_URL) if defaults else argparse.SUPPRESS
    key = API_KEY.read() if defaults else argparse.SUPPRESS
    parser.add_argument("--url", default=url, help=f"the server (env HOTWIRE_URL; default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=key, help="the key the server's /steer routes want (env HOTWIRE_API_KEY)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotwire",
        description="Manage hotwire steering vectors on a vLLM server.",
        epilog=f"The server is {DEFAULT_URL} unless --url or HOTWIRE_URL names another (e.g. "
        "HOTWIRE_URL=http://gpu-box:9000); one that guards /steer/* wants its key in --api-key or HOTWIRE_API_KEY. "
        "Both go before or after the command.",
    )
    _server_options(parser, defaults=True)
    server = argparse.ArgumentParser(add_help=False)
    _server_options(server, defaults=False)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, parents=[server])

    register = command("register", "register a vector from a .safetensors, .gguf or .json file, or an SAE folder")
    register.add_argument("id")
    register.add_argument("file")
    register.add_argument("--replace", action="store_true", help="replace a vector with the same id")
    register.add_argument("--layers", type=_layers, help="layers naming the rows of a single tensor, e.g. 10,12")
    register.add_argument("--feature", type=int, help="FILE is an SAE folder (SAELens): register this feature")
    export = command("export", "write a vector to a file (safetensors, or GGUF for llama.cpp / repeng)")
    export.add_argument("id")
    export.add_argument("out")
    export.add_argument("--format", choices=("safetensors", "gguf"), help="default: from OUT's suffix")
    export.add_argument("--version", type=int, help="a retained version (default: the current one)")
    extract = command("extract", "compute a vector from contrastive examples (JSONL) on the server and register it")
    extract.add_argument("id")
    extract.add_argument("--jsonl", required=True, help="one {positive, negative} object per line")
    extract.add_argument("--layers", default="all", help="all (default), a range like 8-20, or 10,12")
    extract.add_argument("--method", choices=("mean_diff", "pca"), default="mean_diff")
    extract.add_argument("--position", choices=("last", "mean"), default="last")
    extract.add_argument("--normalize", action="store_true", help="unit length at every layer")
    extract.add_argument("--replace", action="store_true", help="replace a vector with the same id")
    extract.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server (600)")
    complete = command("complete", "one completion, steered (--steer) and/or reading probes (--read, needs "
                       "HOTWIRE_READOUT=1 on the server); prints its text, receipt and readout")
    complete.add_argument("prompt")
    complete.add_argument("--steer", action="append", type=_argument(parse_steering), metavar="ID:LAYER:SCALE",
                          help="steer with a vector at a layer (repeatable)")
    complete.add_argument("--spec", help="a whole spec as JSON (vllm_xargs.hotwire), instead of --steer")
    complete.add_argument("--read", action="append", type=_argument(parse_probe), metavar="ID:LAYER[:BIAS]",
                          help="read a vector as a probe at a layer (repeatable)")
    complete.add_argument("--tokens", choices=("generated", "prompt", "all"), default="generated",
                          help="the tokens --read reads (generated)")
    complete.add_argument("--max-tokens", type=int, default=16)
    complete.add_argument("--temperature", type=float, default=0.0)
    complete.add_argument("--model", help="default: the server's first")
    complete.add_argument("--vllm-key", help="vLLM's --api-key where it is not --api-key (which then goes in "
                          "X-Hotwire-Key, as a server with HOTWIRE_KEYS_FILE wants)")
    command("list", "list registered vectors")
    command("slots", "show steering bank occupancy and counters")
    command("fleet", "show every replica on the server's registry (HOTWIRE_REGISTRY): slots, versions held")
    delete = command("delete", "delete a vector")
    delete.add_argument("id")
    monitors = command("monitors", "list, add or delete the probes read on every request (HOTWIRE_READOUT=1)")
    watch = monitors.add_subparsers(dest="action", required=True)
    watch.add_parser("list", help="the monitors", parents=[server])
    add_monitor = watch.add_parser("add", help="read a vector as a probe on every request", parents=[server])
    add_monitor.add_argument("id")
    for name in ("probe", "layer", "threshold"):
        add_monitor.add_argument(f"--{name}", required=True, type={"layer": int, "threshold": float}.get(name, str))
    add_monitor.add_argument("--bias", type=float, default=0.0)
    add_monitor.add_argument("--flag", choices=("above", "below"), default="above")
    add_monitor.add_argument("--scope", choices=("generated", "prompt"), default="generated")
    add_monitor.add_argument("--reduce", choices=("max", "mean", "min"), default="max")
    add_monitor.add_argument("--replace", action="store_true", help="replace a monitor with the same id")
    watch.add_parser("delete", help="delete a monitor", parents=[server]).add_argument("id")
    keys = commands.add_parser("keys", help="add, rotate, revoke or list the keys of a keys file (HOTWIRE_KEYS_FILE)")
    keys.add_argument("--file", default=os.environ.get("HOTWIRE_KEYS_FILE"),
                      help="the keys file (default: HOTWIRE_KEYS_FILE)")
    keys.add_argument("--fleet", metavar="MODEL", help="edit the fleet's keys (HOTWIRE_FLEET_KEYS) of the served model "
                      "MODEL in the Redis of HOTWIRE_REGISTRY, instead of a file")
    actions = keys.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="add a key and print it (the file keeps only its hash)")
    add.add_argument("name")
    add.add_argument("--role", required=True, choices=[role.value for role in Role])
    add.add_argument("--tenant", help="the tenant the key belongs to: it sees that tenant's vectors and the shared "
                     "ones (default: none, an operator's key)")
    rotate = actions.add_parser("rotate", help="replace a key with a new one of the same role, and print it")
    rotate.add_argument("name")
    actions.add_parser("revoke", help="remove a key").add_argument("name")
    actions.add_parser("list", help="names, roles and dates of the keys")
    return parser


def _keys(args: argparse.Namespace) -> object:
    if args.fleet:
        return asyncio.run(_fleet_keys(args))
    if not args.file:
        raise ValueError("no keys file: pass --file or set HOTWIRE_KEYS_FILE")
    if args.action == "add":
        key = add_key(args.file, args.name, Role(args.role), args.tenant)
        return {"name": args.name, "role": args.role, **({"tenant": args.tenant} if args.tenant else {}), "key": key}
    if args.action == "rotate":
        return {"name": args.name, "key": rotate_key(args.file, args.name)}
    if args.action == "revoke":
        revoke_key(args.file, args.name)
        return {"name": args.name, "revoked": True}
    return [key.model_dump(mode="json", exclude={"sha256"}) for key in read_keys(args.file)]


async def _fleet_keys(args: argparse.Namespace) -> object:
    """``hotwire keys --fleet MODEL``: the edit made in the fleet's Redis, recorded as the CLI's."""
    url = registry_url(os.environ.get("HOTWIRE_REGISTRY", ""))
    if url is None:
        raise ValueError("--fleet edits the keys in the fleet's Redis: set HOTWIRE_REGISTRY to its URL")
    registry = RedisRegistry(FleetConfig.from_env(url), Keys.for_model(args.fleet))
    ring = FleetKeys(replica="cli", gated=False)  # it may make a new Redis's first key
    try:
        ring.fleet = registry
        if args.action == "add":
            key = await ring.add(args.name, Role(args.role), args.tenant, "cli")
            return {"name": args.name, "role": args.role, **({"tenant": args.tenant} if args.tenant else {}), "key": key}
        if args.action == "rotate":
            return {"name": args.name, "key": await ring.rotate(args.name, "cli")}
        if args.action == "revoke":
            await ring.revoke(args.name, False, "cli")
            return {"name": args.name, "revoked": True}
        return [key.model_dump(mode="json", exclude={"sha256"}) for key in await ring.keys()]
    finally:
        await registry.close()


def _run(client: HotwireClient, args: argparse.Namespace) -> object:
    if args.command == "register":
        if args.feature is not None:
            if args.layers is not None:
                raise ValueError("--layers does not go with --feature: the SAE's hook point names the layer")
            return client.register_sae(args.id, args.file, args.feature, replace=args.replace).model_dump()
        return client.register(args.id, args.file, layers=args.layers, replace=args.replace).model_dump()
    if args.command == "export":
        file_format = args.format or ("gguf" if args.out.lower().endswith(".gguf") else "safetensors")
        raw = client.export(args.id, file_format, args.version)
        with open(args.out, "wb") as f:
            f.write(raw)
        return {"id": args.id, "format": file_format, "path": args.out, "bytes": len(raw)}
    if args.command == "extract":
        positive, negative = read_examples(args.jsonl)
        layers = args.layers if args.layers == "all" or "-" in args.layers else _layers(args.layers)
        return client.extract(args.id, positive, negative, layers, args.method, args.position, args.normalize,
                              args.replace, timeout=args.timeout).model_dump()
    if args.command == "complete":
        if args.spec is not None and args.steer:
            raise ValueError("pass --steer or --spec, not both")
        return client.complete(args.prompt, args.max_tokens, steer=args.spec or args.steer, read=args.read,
                               tokens=args.tokens, model=args.model, api_key=args.vllm_key,
                               temperature=args.temperature).model_dump()
    if args.command == "list":
        return [meta.model_dump() for meta in client.list()]
    if args.command == "slots":
        return client.slots().model_dump()
    if args.command == "fleet":
        return client.fleet().model_dump()
    if args.command == "monitors":
        return _monitors(client, args)
    return client.delete(args.id).model_dump()


def _monitors(client: HotwireClient, args: argparse.Namespace) -> object:
    if args.action == "add":
        fields = ("probe", "layer", "threshold", "bias", "flag", "scope", "reduce")
        monitor = {"id": args.id, **{name: getattr(args, name) for name in fields}}
        return [m.model_dump() for m in client.add_monitor(monitor, replace=args.replace)]
    if args.action == "delete":
        client.delete_monitor(args.id)
        return {"id": args.id, "deleted": True}
    return [m.model_dump() for m in client.monitors()]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "keys":
            result = _keys(args)
        else:
            with HotwireClient(args.url, args.api_key) as client:
                result = _run(client, args)
    except HotwireError as err:
        where = f", field {err.field}" if err.field else ""
        print(f"hotwire: {err.message} (HTTP {err.status} {err.code}{where})", file=sys.stderr)
        return 1
    except httpx.HTTPError as err:
        print(f"hotwire: cannot reach {args.url}: {err}", file=sys.stderr)
        return 1
    except pydantic.ValidationError as err:  # a ValueError, but the server's fault, not the caller's
        print(f"hotwire: {args.url} answered with something this client cannot read (is it a hotwire server of "
              f"the same version?): {err.errors()[0]['msg']}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError) as err:
        print(f"hotwire: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
