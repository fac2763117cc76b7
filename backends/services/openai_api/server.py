"""``flowrl serve openai``: the OpenAI-compatible endpoint's flags, keys and process.

    flowrl serve openai [--host 127.0.0.1] [--port 8791] [--keys-file F | --insecure-loopback]

Keys (``Authorization: Bearer <key>``, as the ``openai`` client sends ``api_key``) map to
namespaces as for every flowrl service (``infra.serving``): from ``--keys-file`` (lines
``namespace:key``) or ``FLOWRL_OPENAI_KEYS`` (``namespace:key,namespace:key``). Without keys the
endpoint starts only with ``--insecure-loopback`` on a loopback address.
"""

from __future__ import annotations

import argparse

from flowrl.backends.services.openai_api.routes import create_app
from flowrl.backends.services.openai_api.service import Limits, OpenAIService
from flowrl.infra import serving
from flowrl.infra.serving import add_serving_arguments, check_exposure, serve, serving_limits

KEYS_VAR = "FLOWRL_OPENAI_KEYS"
PORT = 8791


def command_parser() -> argparse.ArgumentParser:
    """``flowrl serve openai``'s flags: the serving layer's, then the endpoint's own."""
    parser = argparse.ArgumentParser(
        prog="flowrl serve openai",
        description="An OpenAI-compatible endpoint (/v1/models, /v1/chat/completions, "
        "/v1/completions) on registered versions (models:/name/N, models:/name@alias), Tinker "
        "sampler checkpoints (tinker://…) and the base models of FLOWRL_TINKER_MODELS. Keys "
        f"(namespace:key) from --keys-file or {KEYS_VAR}.",
    )
    add_serving_arguments(parser, PORT, KEYS_VAR, Limits.max_body_bytes)
    parser.add_argument("--max-n", type=int, default=Limits.max_n, help="completions a request")
    parser.add_argument(
        "--max-tokens", type=int, default=Limits.max_tokens, help="sampled tokens a completion"
    )
    parser.add_argument(
        "--resident-models",
        type=int,
        default=Limits.resident_models,
        help="models kept loaded at once (the least recently used is unloaded)",
    )
    return parser


def check_keys(args: argparse.Namespace) -> dict[str, str]:
    """The keys to serve, or ``SystemExit`` naming why the endpoint may not start."""
    keys = serving.read_keys(args.keys_file, [KEYS_VAR])
    check_exposure(args.host, keys, args.insecure_loopback)
    return keys


def run(args: argparse.Namespace, keys: dict[str, str]) -> None:
    """Serve until interrupted."""
    for flag in ("max_n", "max_tokens", "resident_models"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1")
    shared = serving_limits(args)
    limits = Limits(
        max_body_bytes=shared.max_body_bytes,
        max_requests_per_s=shared.max_requests_per_s,
        max_n=args.max_n,
        max_tokens=args.max_tokens,
        resident_models=args.resident_models,
    )
    serve(create_app(OpenAIService(keys=keys, limits=limits)), args.host, args.port)
