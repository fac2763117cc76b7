"""The ``flowrl`` command line.

    flowrl train [CONFIG.yaml] [--set key=value ...] [--verbose]
    flowrl eval [CONFIG.yaml] [--set key=value ...]   # models side by side (pass@k, avg@k)
    flowrl config [CONFIG.yaml] [--set key=value ...]
    flowrl infra up [--no-deployments]          # pool, queues, gpu limit, deployments
    flowrl stack up|down|status|env [--gpus N]  # local Prefect/worker/Ray/MLflow/S3
    flowrl jobs submit|status|list|cancel|wait|metrics|result ...
    flowrl serve tinker [--keys-file F | --insecure-loopback] [--placement local|sessions|shared]
    flowrl serve environments [--keys-file F | --insecure-loopback] [--env NAME ...]
    flowrl serve openai [--keys-file F | --insecure-loopback]
    flowrl tinker models | tokenizer NAME --out DIR

``train`` validates the config before anything starts (a bad field fails at once, naming the
field), then runs the ``rl-train`` flow in this process and prints the result.

``jobs`` and ``infra up`` talk to the Prefect API of ``PREFECT_API_URL`` (or
``FLOWRL_PREFECT_API_URL``) if set; else to the running local stack, the one under
``FLOWRL_HOME`` or else the one ``flowrl stack up`` last started (named by
``~/.config/flowrl/stack.json``, in any directory). With neither they say so and stop.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

from flowrl import __version__


def _add_config_arguments(parser: argparse.ArgumentParser, verbose: bool = True) -> None:
    parser.add_argument("config", nargs="?", help="YAML job config; omitted = embedded defaults.")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a config field, e.g. --set schedule.steps=50 (repeatable).",
    )
    if verbose:
        parser.add_argument("--verbose", action="store_true", help="Show Prefect's INFO logs.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"flowrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("train", "an RL training job (the rl-train flow)"),
        ("selfplay", "a multi-agent self-play job (the self-play flow)"),
        ("sft", "a supervised fine-tuning job (the sft-train flow)"),
        ("eval", "an evaluation job: models side by side (the evaluate flow)"),
    ):
        _add_config_arguments(sub.add_parser(name, help=f"Run {text} in this process."))
    show = sub.add_parser("config", help="Print the validated RL config (defaults filled in).")
    _add_config_arguments(show, verbose=False)
    _add_infra_commands(sub)
    _add_serve_commands(sub)
    _add_tinker_commands(sub)
    return parser


SERVICES = {
    "tinker": "The Tinker API for the official tinker SDK (base_url=http://HOST:PORT).",
    "environments": "Environments over HTTP, for jobs with env.mode: http.",
    "openai": "An OpenAI-compatible endpoint on registered versions, Tinker checkpoints and "
    "base models (base_url=http://HOST:PORT/v1).",
}
"""What ``flowrl serve NAME`` serves. Each takes the serving layer's flags (``--host``,
``--port``, ``--keys-file``, ``--insecure-loopback``, ``--max-body-bytes``,
``--max-requests-per-second``) and its own: ``flowrl serve NAME --help``."""


def _add_serve_commands(sub) -> None:
    """``flowrl serve NAME``: listed here; its flags are the service's own (``_serve``)."""
    serve = sub.add_parser(
        "serve",
        help="Serve an HTTP API: tinker (the Tinker API), openai (OpenAI-compatible) or "
        "environments.",
        description="flowrl serve NAME --help lists a service's flags.",
    )
    what = serve.add_subparsers(dest="service", required=True)
    for name, text in SERVICES.items():
        what.add_parser(name, help=text, add_help=False)


def _add_tinker_commands(sub) -> None:
    tinker = sub.add_parser("tinker", help="Base models of the Tinker API, for thin clients.")
    tsub = tinker.add_subparsers(dest="action", required=True)
    tsub.add_parser("models", help="List the catalogue: name and URI.")
    tok = tsub.add_parser(
        "tokenizer",
        help="Write a catalogue model's tokenizer folder (for a client's AutoTokenizer).",
    )
    tok.add_argument("name", help="Base model name, e.g. flowrl/tiny.")
    tok.add_argument("--out", required=True, help="Folder to write the tokenizer files to.")
    reg = tsub.add_parser(
        "register",
        help="Register a checkpoint (tinker://…) as an MLflow Model version (LoRA merged).",
        description="The checkpoint of the namespace FLOWRL_NAMESPACE (its API key's) becomes a "
        "version of the registered model NAME (namespace-scoped), with lineage; prints its URI.",
    )
    reg.add_argument("path", help="tinker://<run>/sampler_weights/<name> (or weights/<name>).")
    reg.add_argument("--name", required=True, help="Registered model name.")


def _add_infra_commands(sub) -> None:
    infra = sub.add_parser(
        "infra",
        help="Apply the scheduler declaration and deployments.",
        description="Apply them to the Prefect API of PREFECT_API_URL (or "
        "FLOWRL_PREFECT_API_URL) if set, else to the running local stack (found as `flowrl "
        "jobs` finds it).",
    )
    infra.add_argument("action", choices=["up"], help="up: create or update them.")
    infra.add_argument("--no-deployments", action="store_true", help="Only pool/queues/limit.")
    stack = sub.add_parser(
        "stack",
        help="The local stack (Prefect, worker, Ray, MLflow, S3).",
        description="The local stack on 127.0.0.1. Its state lives in "
        "$FLOWRL_HOME/stack/state.json (FLOWRL_HOME defaults to ./.flowrl); `up` also writes "
        "$FLOWRL_CONFIG_DIR/stack.json (default ~/.config/flowrl/stack.json), which lets "
        "`flowrl jobs` and `flowrl stack status|env|down` find it from any directory.",
    )
    stack.add_argument(
        "action",
        choices=["up", "down", "status", "env"],
        help="up: start every component and print the UI links; down: stop them by PID; "
        "status: the UI links and what runs; env: the variables that point a shell at it.",
    )
    stack.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="GPU slots of the pool, also the Ray head's GPUs (default: the scheduler "
        "declaration's pool.gpus, 2 in infra/scheduler.yaml). On a machine without GPUs they "
        "are logical: a job with resources.gpus=1 is admitted and runs on the CPU. On a GPU "
        "machine give at most its number of GPUs.",
    )
    stack.add_argument("--no-ray", action="store_true", help="Do not start a Ray head.")
    stack.add_argument(
        "--no-deployments", action="store_true", help="Do not apply prefect.yaml's deployments."
    )
    stack.add_argument(
        "--json", action="store_true", help="status: print it as JSON (UI links, components)."
    )
    jobs = sub.add_parser(
        "jobs",
        help="Submit and follow jobs on the Prefect API.",
        description="Jobs on the Prefect API of PREFECT_API_URL (or FLOWRL_PREFECT_API_URL) if "
        "set; else on the running local stack: the one under FLOWRL_HOME, else the one "
        "`flowrl stack up` last started (named by $FLOWRL_CONFIG_DIR/stack.json, default "
        "~/.config/flowrl/stack.json), from any directory.",
    )
    jsub = jobs.add_subparsers(dest="action", required=True)
    submit = jsub.add_parser("submit", help="Submit a job to a deployment; prints its id.")
    submit.add_argument("deployment", help="Deployment name, e.g. rl-train or gpu-probe.")
    submit.add_argument("config", nargs="?", help="YAML job config (the `config` parameter).")
    submit.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="K=V",
        help="Override one config field (dotted path, YAML value); repeatable.",
    )
    submit.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="K=V",
        help="Other flow parameter (YAML value), e.g. --param seconds=2.",
    )
    submit.add_argument("--queue", help="Work queue (default: the deployment's).")
    for verb, text in (
        ("status", "Print a job's state; exit 1 if it FAILED, CRASHED or was CANCELLED."),
        ("cancel", "Cancel a job."),
        ("metrics", "Print a finished job's latest MLflow metrics."),
        ("result", "Print a finished job's result."),
    ):
        jsub.add_parser(verb, help=text).add_argument(
            "run_id", help="Prefect flow-run id (printed by `jobs submit` and `jobs list`)."
        )
    wait = jsub.add_parser("wait", help="Wait for a job to end; exit 1 unless it COMPLETED.")
    wait.add_argument("run_id", help="Prefect flow-run id.")
    wait.add_argument("--timeout", type=float, default=3600, help="Seconds to wait at most.")
    listing = jsub.add_parser("list", help="List recent jobs with their state and queue.")
    listing.add_argument("--limit", type=int, default=20, help="Jobs to list.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "serve" and argv[1] in SERVICES:
        return _serve(argv[1], argv[2:])
    args = _parser().parse_args(argv)
    if args.command in ("infra", "stack", "jobs"):
        return _ops(args)
    if args.command == "tinker":
        return _tinker(args)
    from flowrl.infra.configfile import ConfigError
    from flowrl.tasks.schemas import (
        EvalJobConfig,
        RLJobConfig,
        SelfPlayJobConfig,
        SFTJobConfig,
        load_job,
    )

    kinds = {"selfplay": SelfPlayJobConfig, "sft": SFTJobConfig, "eval": EvalJobConfig}
    try:
        config = load_job(args.config, args.overrides, kinds.get(args.command, RLJobConfig))
    except ConfigError as err:
        print(f"flowrl: {err}", file=sys.stderr)
        return 2
    if args.command == "config":
        import yaml

        print(yaml.safe_dump(config.model_dump(), sort_keys=False))
        return 0
    if args.command == "eval":
        return _eval(config, args.verbose)
    from flowrl.backends.models.chat import check_chat_template
    from flowrl.backends.models.model_uri import check_model_source

    try:  # before any server or worker starts
        check_model_source(config.model.source)
        model, env = config.model, getattr(config, "env", None)
        task = env.task(config.seed) if env is not None and args.command == "train" else None
        check_chat_template(model.source, model.chat_format, model.tool_messages, task)
        resources = getattr(config, "resources", None)
        if resources is not None and resources.sampler_backend != "hf":
            from flowrl.backends.policy.resources import SAMPLER_BACKENDS
            from flowrl.backends.policy.workers import backend_runtime_env

            backend_runtime_env(SAMPLER_BACKENDS[resources.sampler_backend])
    except ValueError as err:
        print(f"flowrl: {err}", file=sys.stderr)
        return 2
    _prepare(verbose=args.verbose)
    from flowrl.flows.engines import start_engines

    engines_ready = start_engines()  # Ray and Prefect's API boot while the flow imports
    if args.command == "selfplay":
        from flowrl.flows.selfplay import self_play

        engines_ready()
        print(f"\n{self_play(config)}")
        return 0
    if args.command == "sft":
        from flowrl.flows.sft import sft_train

        engines_ready()
        print(f"\n{sft_train(config)}")
        return 0
    return _train(config, engines_ready)


def _serve(name: str, argv: list[str]) -> int:
    """Run one service until interrupted; a reason it may not start is one line, exit 2."""
    try:
        if name == "environments":
            from flowrl.environments.service import main as serve_environments

            serve_environments(argv)
        elif name == "openai":
            _serve_openai(argv)
        else:
            _serve_tinker(argv)
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            return err.code or 0
        print(f"flowrl: {err}", file=sys.stderr)
        return 2
    return 0


def _eval(config, verbose: bool) -> int:
    """The evaluate flow in this process; its table of models side by side."""
    _prepare(verbose=verbose)  # before Prefect is imported: it reads its log level then
    from flowrl.flows.evaluate import evaluate, resolve_models, side_by_side

    try:
        resolve_models(config.models)  # a reference that does not resolve: before anything runs
    except ValueError as err:
        print(f"flowrl: {err}", file=sys.stderr)
        return 2
    result = evaluate(config)
    rows = side_by_side(result.models, result.scores)
    columns = list(rows[0])
    widths = [max(len(str(c)), *(len(str(r[c])) for r in rows)) for c in columns]
    print()
    for line in (dict(zip(columns, columns, strict=True)), *rows):
        print("  ".join(str(line[c]).ljust(w) for c, w in zip(columns, widths, strict=True)))
    print(f"\nMLflow run: {result.mlflow_run_id}; one per model: {', '.join(result.model_runs)}")
    return 0


def _serve_tinker(argv: list[str]) -> None:
    """``flowrl serve tinker``: the keys checked before anything starts, then the placement the
    flags ask for, then the service until interrupted."""
    from flowrl.backends.services.tinker import server
    from flowrl.infra.settings import get_settings

    args = server.parse_args(argv)
    keys = server.check_keys(args)
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    get_settings().apply_to_environment()
    placement = server.placement_for(args, _session_runs)
    print(f"Tinker API on http://{args.host}:{args.port} ({args.placement})", flush=True)
    server.run(args, keys, placement)


def _serve_openai(argv: list[str]) -> None:
    """``flowrl serve openai``: the keys checked before anything starts, then the endpoint
    until interrupted."""
    from flowrl.backends.services.openai_api import server
    from flowrl.infra.settings import get_settings

    args = server.command_parser().parse_args(argv)
    keys = server.check_keys(args)
    get_settings().apply_to_environment()
    print(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1", flush=True)
    server.run(args, keys)


def _session_runs():
    """The Tinker API's session runs: runs of the ``tinker-session`` deployment."""
    from flowrl.flows.tinker_session import DeploymentRuns

    return DeploymentRuns()


def _tinker(args) -> int:
    from flowrl.backends.models.tinker_checkpoints import resolve_base_model
    from flowrl.infra.settings import get_settings

    settings = get_settings()
    catalogue = settings.tinker_models
    if args.action == "register":
        from flowrl.infra.serving import ServiceError
        from flowrl.tasks.tinker import register_checkpoint

        settings.apply_to_environment()
        try:
            print(register_checkpoint(args.path, args.name))
        except (ServiceError, ValueError, PermissionError) as err:
            print(f"flowrl: {err}", file=sys.stderr)
            return 2
        return 0
    if args.action == "models":
        for name, uri in sorted(catalogue.items()):
            print(f"{name:<32} {uri}")
        return 0
    if args.name not in catalogue:
        print(
            f"flowrl: unknown base model {args.name!r} (have: {sorted(catalogue)})", file=sys.stderr
        )
        return 2
    from flowrl.backends.models.model_folder import load_tokenizer

    load_tokenizer(
        resolve_base_model(catalogue[args.name], settings.model_cache_dir)
    ).save_pretrained(args.out)
    print(args.out)
    return 0


def _prepare(verbose: bool) -> None:
    # SIGTERM (`kill`, a process manager) ends a run as Ctrl-C does: the job's clean-up runs and
    # Prefect's API server, if this process started one, stops with it (by default it lives on).
    signal.signal(signal.SIGTERM, _terminated)
    if not verbose:
        # Keep the terminal for the progress bar; the logs still reach the Prefect API.
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from flowrl.infra.settings import get_settings

    get_settings().apply_to_environment()


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _train(config, engines_ready: Callable[[], None]) -> int:
    from flowrl.flows.rl import rl_train
    from flowrl.infra.settings import get_settings

    engines_ready()
    result = rl_train(config)
    print()
    print(f"held-out accuracy at the start of RL : {result.accuracy_start:.3f}")
    print(f"held-out accuracy at the end         : {result.accuracy_end:.3f}")
    print(f"registered model                     : {result.model_uri}")
    print(f"MLflow run                           : {result.mlflow_run_id}")
    print(f"MLflow tracking URI                  : {get_settings().tracking_uri}")
    return 0


def _ops(args) -> int:
    from flowrl.infra.configfile import ConfigError
    from flowrl.infra.scheduler import AdmissionError
    from flowrl.infra.servers import MissingComponentError
    from flowrl.infra.stack import ComponentDownError, NoStackError

    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    try:
        if args.command == "stack":
            return _stack(args)
        if getattr(args, "run_id", None) is not None:
            _check_run_id(args.run_id)  # before anything connects or writes
        from flowrl.infra.stack import apply_stack_env, check_component

        local = apply_stack_env()  # a Prefect API if set, else the running local stack, else stop
        if local is not None:  # what this command needs of the stack answers, or one line
            for name in _NEEDS.get(getattr(args, "action", None), ("prefect",)):
                check_component(local, name)
        from flowrl.infra.settings import get_settings

        get_settings().apply_to_environment()
        if args.command == "infra":
            return _infra_up(args.no_deployments)
        return _jobs(args)
    except AdmissionError as err:
        print(f"flowrl: refused: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"flowrl: {err}", file=sys.stderr)
        return 2
    except (NoStackError, ComponentDownError, MissingComponentError, _NotFound) as err:
        print(f"flowrl: {err}", file=sys.stderr)
        return 1


_NEEDS = {"metrics": ("prefect", "mlflow"), "result": ("prefect", "s3")}
"""The stack's components a ``jobs`` command talks to (others: the Prefect API only)."""


class _NotFound(LookupError):
    """A run id that is not a UUID, or a run or deployment the Prefect API does not know."""


def _check_run_id(run_id: str) -> None:
    from uuid import UUID

    try:
        UUID(run_id)
    except ValueError:
        raise _NotFound(
            f"{run_id!r} is not a flow-run id (a UUID, as `flowrl jobs submit` and "
            "`flowrl jobs list` print)"
        ) from None


def _infra_up(no_deployments: bool) -> int:
    import asyncio

    from flowrl.infra.scheduler import apply_scheduler, load_scheduler

    spec = load_scheduler()
    for line in asyncio.run(apply_scheduler(spec)):
        print(line)
    if not no_deployments:
        from flowrl.infra.deployments import apply_deployments

        for line in apply_deployments(spec):
            print(line)
    return 0


def _stack(args) -> int:
    from flowrl.infra import stack

    if args.action == "up":
        stack.check_installed()  # a missing piece: one line naming its install, nothing started
        print("starting the local stack (about 30-60 s):", file=sys.stderr, flush=True)
        state = stack.stack_up(
            gpus=args.gpus, deploy=not args.no_deployments, ray=not args.no_ray, progress=True
        )
        path = stack.state_file()
    else:
        path = stack.known_state_file()  # FLOWRL_HOME's, else the one the pointer names
        state = stack.StackState.load(path) if path is not None else None
        if state is None:
            if args.action == "down":
                print("stopped: nothing")
                return 0
            print("flowrl: no local stack (start one with `flowrl stack up`)", file=sys.stderr)
            return 1
    if args.action == "down":
        print("stopped:", ", ".join(stack.stack_down(path)) or "nothing")
        return 0
    if args.action == "env":
        for key, value in state.env.items():
            print(f"export {key}={value}")
        return 0
    return _stack_status(state, path, args.json)


def _stack_status(state, path, as_json: bool) -> int:
    """``flowrl stack status``: the UI links, the supervisor, each component's pid, state,
    restarts and address (or all of it as JSON); exit 0 only if everything is RUNNING."""
    import json

    from flowrl.infra import stack

    status = stack.component_status(state)
    for entry in status.values():
        entry["alive"] = entry["state"] == "RUNNING"
    up = state.running() and all(e["alive"] for e in status.values())
    if as_json:
        sup = {**state.supervisor, "alive": state.running()} if state.supervisor else None
        out = {"state_file": str(path), "ui": state.ui, "supervisor": sup, "components": status}
        print(json.dumps(out, indent=2))
        return 0 if up else 1
    names = {"prefect": "Prefect UI", "mlflow": "MLflow UI"}
    for key, url in state.ui.items():
        print(f"{names[key]:<11} {url}")
    print()
    if state.supervisor:
        word = "running" if state.running() else "EXITED: `flowrl stack up` starts it again"
        print(f"supervisor (supervisord) pid {state.supervisor['pid']}: {word}")
    print(f"{'component':<10} {'pid':>8}  {'state':<9} {'restarts':>8}  url")
    for name, e in status.items():
        print(f"{name:<10} {e['pid']:>8}  {e['state']:<9} {e['restarts']:>8}  {e['url']}")
        if e["last_reason"]:
            print(f"{'':<10} {'':>8}  last restart: {e['last_reason']}")
    print(f"\nstate: {path}  (logs beside it)")
    return 0 if up else 1


def _submit_parameters(args) -> dict:
    import yaml

    from flowrl.infra.configfile import read_mapping

    params = {k: v for k, v in (p.partition("=")[::2] for p in args.param)}
    params = {k: yaml.safe_load(v) for k, v in params.items()}
    if args.config or args.overrides:
        params["config"] = read_mapping(args.config, args.overrides)
    return params


def _jobs(args) -> int:
    from prefect.exceptions import ObjectNotFound

    try:
        return _jobs_on_api(args)
    except ObjectNotFound:
        if getattr(args, "run_id", None) is not None:
            what = f"flow run {args.run_id}"
        elif args.action == "submit":
            what = f"deployment {args.deployment!r}"
        else:
            raise
        raise _NotFound(f"no {what} on the Prefect API at {_api_url()}") from None
    except LookupError as err:  # JobClient.deployment_name: no or several deployments
        if args.action != "submit" or isinstance(err, KeyError):
            raise
        raise _NotFound(f"{err} on the Prefect API at {_api_url()}") from None


def _api_url() -> str:
    return os.environ.get("PREFECT_API_URL", "(unset)")


def _jobs_on_api(args) -> int:
    from flowrl.infra.client import JobClient

    jobs = JobClient()
    if args.action == "submit":
        print(jobs.submit(args.deployment, _submit_parameters(args), queue=args.queue))
        return 0
    if args.action == "list":
        for j in jobs.list(limit=args.limit):
            print(f"{j.id}  {j.state:<10} {j.queue or '-':<10} {j.deployment or '-':<16} {j.name}")
        return 0
    if args.action == "metrics":
        for key, value in sorted(jobs.metrics(args.run_id).items()):
            print(f"{key:<32} {value:.4f}")
        return 0
    if args.action == "result":
        result = jobs.result(args.run_id)
        print(result if result is not None else "no result (yet)")
        return 0 if result is not None else 1
    if args.action == "wait":
        status = jobs.wait(args.run_id, timeout=args.timeout)
    elif args.action == "cancel":
        status = jobs.cancel(args.run_id)
    else:
        status = jobs.status(args.run_id)
    note = f" (attempt {status.attempts}; the stack resumes it)" if status.resumes else ""
    print(f"{status.id}  {status.state}  {status.message or ''}{note}")
    if args.action == "wait":
        return 0 if status.state == "COMPLETED" else 1
    if args.action == "status":
        return 1 if status.final and status.state != "COMPLETED" else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
