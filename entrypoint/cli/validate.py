"""`qwen38 validate`: the validators of `entrypoint.validate`, against any running deployment.

Each prints a table (or ``--json``) and exits non-zero when any check fails.
"""

from __future__ import annotations

import argparse

from core.errors import SettingsError, ValidationFailed
from entrypoint.client import StackClient
from entrypoint.validate.cache_isolation import DEFAULT_PREFIX_TOKENS
from entrypoint.validate.report import Report


def server_target(args: argparse.Namespace) -> tuple[str, str | None]:
    """Base URL and key: explicit flags, else the local deployment's settings.

    The key's precedence is `core.settings.client_api_key`'s, as for every command.
    """
    from core.settings import client_api_key  # the settings' imports only once a validator runs

    if args.base_url:
        return args.base_url, client_api_key(args.api_key, args.api_key_file)
    # the local deployment's settings, only where no --base-url names the server
    from core.settings import load_settings
    from entrypoint.ready import base_url_for  # (the gate's module: only for the local deployment's URL)

    settings = load_settings()
    return base_url_for(settings), client_api_key(args.api_key, args.api_key_file)


def _finish(report: Report, as_json: bool) -> int:
    print(report.to_json() if as_json else report.to_table())
    if report.failed:
        names = ", ".join(f"{c.name} ({c.model})" for c in report.failed[:5])
        raise ValidationFailed(f"{len(report.failed)} check(s) failed: {names}")
    return 0


def _cmd_apis(args: argparse.Namespace) -> int:
    from entrypoint.validate.apis import validate_apis  # each validator imports only its own checks

    base_url, key = server_target(args)
    with StackClient(base_url, key) as client:
        report = validate_apis(client, args.model or None, has_key=key is not None)
    return _finish(report, args.json)


def _cmd_clients(args: argparse.Namespace) -> int:
    from entrypoint.validate.clients import validate_clients  # the openai and anthropic SDKs: only here

    base_url, key = server_target(args)
    return _finish(validate_clients(base_url, key, args.model or None), args.json)


def _cmd_cache(args: argparse.Namespace) -> int:
    from entrypoint.validate.cache_isolation import validate_cache_isolation  # imported where it runs, as its siblings

    base_url, key = server_target(args)
    with StackClient(base_url, key) as client:
        base, adapter = args.base_model, args.adapter_model
        if base is None or adapter is None:
            response = client.get("/v1/models")
            if response.status_code != 200:
                raise ValidationFailed(f"/v1/models answered {response.status_code} (wrong or missing key?)")
            ids = [entry["id"] for entry in response.json()["data"]]
            if not ids:
                raise SettingsError("/v1/models lists no model: name --base-model")
            # One id served (no adapter): reuse within the base is what there is to check.
            base = base or ids[0]
            if adapter is None:
                adapter = next((i for i in ids if i != base), None)
        report = validate_cache_isolation(client, base, adapter or None, args.prefix_tokens)
    return _finish(report, args.json)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", help="server URL (default: from the HOST/PORT settings)")
    parser.add_argument("--api-key", help="API key (visible to other users in `ps`; prefer --api-key-file)")
    parser.add_argument("--api-key-file", help="file holding the API key (default: VLLM_API_KEY or API_KEY_FILE)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate", help="validate a running deployment (APIs, SDK clients, cache isolation)"
    )
    validators = parser.add_subparsers(dest="validator", metavar="VALIDATOR", required=True)

    apis = validators.add_parser("apis", help="chat, completions, responses, messages, tools, errors")
    _common(apis)
    apis.add_argument("--model", action="append", help="model id to check (repeatable; default: all listed)")
    apis.set_defaults(func=_cmd_apis)

    clients = validators.add_parser(
        "clients", help="the openai and anthropic SDKs: chat, responses, messages, streams, tool loops, switches"
    )
    _common(clients)
    clients.add_argument("--model", action="append", help="model id to check (repeatable; default: all listed)")
    clients.set_defaults(func=_cmd_clients)

    cache = validators.add_parser("cache-isolation", help="prefix-cache reuse within, never across, identities")
    _common(cache)
    cache.add_argument("--base-model", help="base id (default: the first listed)")
    cache.add_argument(
        "--adapter-model", help="adapter id (default: the second listed; '' or none listed: the base alone is checked)"
    )
    cache.add_argument("--prefix-tokens", type=int, default=DEFAULT_PREFIX_TOKENS,
                       help="length of the shared prefix (clamped below the max context)")
    cache.set_defaults(func=_cmd_cache)
