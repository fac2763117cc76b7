"""``flowrl serve tinker``: the Tinker API's flags, keys and process.

    flowrl serve tinker [--host 127.0.0.1] [--port 8790] [--keys-file F | --insecure-loopback]

Keys (``X-API-Key: tml-…``, the SDK's header) map to namespaces as for every flowrl service
(``infra.serving``); they come from ``--keys-file`` (lines ``namespace:tml-key``) or
``FLOWRL_TINKER_KEYS`` (``namespace:key,namespace:key``), never from a config, and a Tinker key
starts with ``tml-`` as the SDK requires. Without keys the service starts only with
``--insecure-loopback`` on a loopback address. Where models live (``--placement``) is a
``backends.policy.placement.Placement``, mapped from the flag once (``placement_for``); the command
line hands in the session runs, which are the flow layer's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from flowrl.backends.policy.placement import Placement, SessionRuns, place
from flowrl.backends.services.tinker.journal import Journal
from flowrl.backends.services.tinker.routes import VERBS, create_app
from flowrl.backends.services.tinker.service import Limits, TinkerService
from flowrl.infra import serving
from flowrl.infra.serving import add_serving_arguments, check_exposure, serve, serving_limits

KEYS_VAR = "FLOWRL_TINKER_KEYS"
MAX_MODELS_VAR = "FLOWRL_TINKER_MAX_MODELS"
KEY_PREFIX = "tml-"
PORT = 8790


def read_keys(path: str | None = None) -> dict[str, str]:
    """API key → namespace, from ``path`` (lines ``namespace:tml-key``) and
    ``FLOWRL_TINKER_KEYS``."""
    return serving.read_keys(path, [KEYS_VAR], key_prefix=KEY_PREFIX)


def command_parser() -> argparse.ArgumentParser:
    """``flowrl serve tinker``'s flags: the serving layer's, then the Tinker API's own."""
    parser = argparse.ArgumentParser(
        prog="flowrl serve tinker",
        description="The Tinker API (docs/tinker.md). Keys (namespace:tml-key) from "
        f"--keys-file or {KEYS_VAR}; base models from FLOWRL_TINKER_MODELS.",
    )
    add_serving_arguments(parser, PORT, KEYS_VAR, Limits.max_body_bytes)
    parser.add_argument(
        "--placement",
        choices=["local", "sessions", "shared"],
        default="local",
        help="local: models in this process; sessions: each training model a Prefect flow run "
        "of the tinker-session deployment, its weights in a Ray actor (needs the stack's "
        "Prefect and Ray; `flowrl stack up` starts the service so); shared: each training "
        "model an adapter on its base model's shared worker, the one rl-train jobs with "
        "resources.placement shared use (needs Prefect and Ray).",
    )
    parser.add_argument(
        "--sampler-engine",
        choices=["hf", "vllm"],
        default="hf",
        help="hf: sampling clients sample on the training models' workers (a saved path of "
        "no live model on a sampling model of the service's); vllm: every sampling client "
        "samples on a vLLM engine of its base model, in a Ray actor on vLLM's venv (`make "
        "setup-vllm`; FLOWRL_VLLM_PYTHON), saved weights loaded as LoRA adapters.",
    )
    parser.add_argument(
        "--session-ttl",
        type=float,
        default=Limits.session_ttl_s,
        help="Seconds without a heartbeat (the SDK sends one every 10 s) before a session ends: "
        "its models are unloaded, their slots freed, its saved states kept.",
    )
    parser.add_argument(
        "--resident-adapters",
        type=int,
        default=None,
        metavar="N",
        help="local placement: LoRA adapters resident in memory on one base model at once "
        "(default: no limit); beyond it the least recently used model is parked on disk and "
        "restored exactly. (Admission, how many tenants a shared worker takes, is "
        "FLOWRL_SHARED_ADAPTER_SLOTS.)",
    )
    parser.add_argument(
        "--journal",
        metavar="DIR",
        default=None,
        help="Keep a journal in DIR (journal.jsonl): a service started again on it carries on "
        "its clients' sessions, models (those that outlive the process: --placement sessions) "
        "and the results they had not taken, so their loops do not notice the restart "
        "(`flowrl stack up` sets it). Without it, sessions end with the process.",
    )
    parser.add_argument(
        "--max-models-per-key",
        type=_positive,
        default=None,
        metavar="N",
        help=f"Live training models one API key may hold (default {MAX_MODELS_VAR}, else "
        f"{Limits.max_models_per_namespace}); one more is refused with a 403 naming the limit.",
    )
    parser.add_argument("--adapter-slots", type=int, help=argparse.SUPPRESS)  # the old name
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command's flags (``--max-models-per-key`` defaults to ``FLOWRL_TINKER_MAX_MODELS``);
    the old ``--adapter-slots`` still works, with a warning."""
    parser = command_parser()
    args = parser.parse_args(argv)
    if args.max_models_per_key is None:
        env = os.environ.get(MAX_MODELS_VAR)
        try:
            limit = _positive(env) if env else Limits.max_models_per_namespace
        except argparse.ArgumentTypeError as err:
            parser.error(f"{MAX_MODELS_VAR}: {err}")
        args.max_models_per_key = limit
    if args.adapter_slots is not None:
        print("warning: --adapter-slots is deprecated; use --resident-adapters", file=sys.stderr)
        args.resident_adapters = args.adapter_slots
    return args


def placement_for(args: argparse.Namespace, session_runs: Callable[[], SessionRuns]) -> Placement:
    """The placement ``--placement`` names: ``local`` → ``InProcess`` (``--resident-adapters``),
    ``sessions`` → ``OwnWorkers`` (each model a run of the session flow holding one GPU slot,
    submitted through ``session_runs()``), ``shared`` → ``SharedTenant`` (the settings' shared
    worker)."""
    if args.placement == "sessions":
        return place("sessions", session_runs=session_runs(), gpus=1)
    if args.placement == "shared":
        return place("shared")
    return place("local", resident_adapters=args.resident_adapters)


def sampler_placement_for(args: argparse.Namespace) -> Placement | None:
    """Where sampling clients sample (``--sampler-engine``): ``VLLMEngines`` for vllm (its venv
    checked now, before the service starts); None for hf, the service's default."""
    if args.sampler_engine != "vllm":
        return None
    from flowrl.backends.policy.resources import TINKER_VLLM_BACKEND
    from flowrl.backends.policy.workers import backend_runtime_env

    try:
        backend_runtime_env(TINKER_VLLM_BACKEND)
    except ValueError as err:
        raise SystemExit(f"flowrl serve tinker --sampler-engine vllm: {err}") from None
    return place("vllm-engines")


def check_keys(args: argparse.Namespace) -> dict[str, str]:
    """The keys to serve, or ``SystemExit`` naming why the service may not start."""
    keys = read_keys(args.keys_file)
    check_exposure(args.host, keys, args.insecure_loopback)
    return keys


def run(args: argparse.Namespace, keys: dict[str, str], placement: Placement) -> None:
    """Serve until interrupted; the service's models are unloaded on the way out."""
    shared = serving_limits(args)
    limits = Limits(
        max_body_bytes=shared.max_body_bytes,
        max_requests_per_s=shared.max_requests_per_s,
        session_ttl_s=args.session_ttl,
        max_models_per_namespace=args.max_models_per_key,
    )
    journal = Journal(Path(args.journal)) if args.journal else None
    service = TinkerService(
        placement,
        keys=keys,
        limits=limits,
        sampler_placement=sampler_placement_for(args),
        journal=journal,
    )
    if journal is not None:
        print(f"journal {journal.path}: {service.recover(VERBS)}", file=sys.stderr, flush=True)
    try:
        serve(create_app(service), args.host, args.port, keep_alive_s=30)
    finally:
        service.close()
