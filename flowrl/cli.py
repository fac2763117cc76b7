"""The ``flowrl`` command line.

    flowrl train [CONFIG.yaml] [--set key=value ...] [--verbose]
    flowrl eval [CONFIG.yaml] [--set key=value ...]   # models side by side (pass@k, avg@k)
    flowrl config [CONFIG.yaml] [--set key=value ...]
    flowrl infra up [--no-deployments]          # pool, queues, gpu limit, deployments
    flowrl stack up|down|status|env [--gpus N]  # local Prefect/worker/Ray/MLflow/S3
    flowrl jobs submit|status|list|cancel|wait|logs|metrics|result ...
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

import os
import signal
import sys
from collections.abc import Callable

from flowrl.cli_parser import SERVICES, command_parser


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:  # a reader that left shows here, not in the interpreter's flush at exit
            sys.stdout.flush()
    except BrokenPipeError:  # the reader left (`flowrl jobs list | head -4`): stop, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "serve" and argv[1] in SERVICES:
        return _serve(argv[1], argv[2:])
    args = command_parser(__doc__.split("\n\n")[0]).parse_args(argv)
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
        if resources is not None and resources.sampler_backend == "vllm":
            from flowrl.backends.policy.resources import SAMPLER_BACKENDS
            from flowrl.backends.policy.workers import backend_runtime_env

            backend_runtime_env(SAMPLER_BACKENDS[resources.sampler_backend])
    except ValueError as err:
        print(f"flowrl: {err}", file=sys.stderr)
        return 2
    _prepare(verbose=args.verbose)
    from flowrl.flows.engines import start_engines

    engines_ready = start_engines()  # Ray and Prefect's API boot while the flow imports
    try:
        return _run_job(args.command, config, engines_ready)
    except SystemExit as stop:
        if stop.code == 128 + signal.SIGTERM:  # _terminated: the last line is flowrl's own
            again = " (the same command resumes it from its last checkpoint)"
            print(
                f"\nflowrl: job {config.name!r} stopped by SIGTERM (exit {stop.code})"
                + (again if args.command in ("train", "selfplay") else ""),
                file=sys.stderr,
            )
        raise


def _run_job(command: str, config, engines_ready: Callable[[], None]) -> int:
    if command == "selfplay":
        from flowrl.flows.selfplay import self_play

        engines_ready()
        print(f"\n{self_play(config)}")
        return 0
    if command == "sft":
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
        # Keep the terminal for the progress bar and flowrl's own lines; the logs still reach
        # the Prefect API. Off: Prefect's INFO logs and telemetry notice, MLflow's notices
        # (database set-up, model-logging warnings), Ray's start-up lines (flows.engines).
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # registration's
    else:
        os.environ["FLOWRL_VERBOSE"] = "1"
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
    except Exception as err:
        from flowrl.infra.client import api_restarting

        if not api_restarting(err):
            raise
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        print(
            f"flowrl: the Prefect API at {_api_url()} does not answer ({reason})", file=sys.stderr
        )
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
    from flowrl.infra.configfile import ConfigError, parse_yaml, read_mapping

    params = {}
    for item in args.param:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--param {item[:80]!r}: expected key=value")
        params[key.strip()] = parse_yaml(value, f"--param {key.strip()[:80]}")
    if args.config or args.overrides:
        params["config"] = read_mapping(args.config, args.overrides)
    return params


def _jobs(args) -> int:
    from prefect.exceptions import ObjectNotFound

    try:
        return _jobs_on_api(args)
    except KeyboardInterrupt:  # Ctrl-C, on wait or logs --follow above all
        run_id = getattr(args, "run_id", None)
        if args.action in ("wait", "logs") and run_id:
            print(
                f"\nflowrl: stopped following {run_id}; the job goes on "
                f"(`flowrl jobs cancel {run_id}` stops it)",
                file=sys.stderr,
            )
        else:
            print("\nflowrl: interrupted", file=sys.stderr)
        return 130
    except TimeoutError as err:  # wait --timeout
        print(f"flowrl: {err}; it goes on", file=sys.stderr)
        return 124
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


def _print(out: str | list[str]) -> None:
    """One document, or lines (none for an empty list)."""
    for line in [out] if isinstance(out, str) else out:
        print(line)


def _json(value: object) -> str:
    """``--json``'s output: one JSON document (times as ISO strings)."""
    import json

    return json.dumps(value, default=str, sort_keys=True)


def _status_view(status: object) -> dict:
    """A ``JobStatus`` as ``--json`` prints it (its fields and ``final``)."""
    import dataclasses

    return {**dataclasses.asdict(status), "final": status.final}  # type: ignore[call-overload,attr-defined]


def _api_url() -> str:
    return os.environ.get("PREFECT_API_URL", "(unset)")


def _jobs_on_api(args) -> int:
    from flowrl.infra.client import JobClient

    jobs = JobClient()
    as_json = getattr(args, "json", False)
    if args.action == "submit":
        run_id = jobs.submit(args.deployment, _submit_parameters(args), queue=args.queue)
        print(_json({"id": run_id}) if as_json else run_id)
        return 0
    if args.action in ("list", "metrics", "result"):
        return _print_listing(jobs, args, as_json)
    if args.action == "logs":
        return _logs(jobs, args)
    if args.action == "wait":
        status = _wait(jobs, args)
    elif args.action == "cancel":
        status = jobs.cancel(args.run_id)
    else:
        status = jobs.status(args.run_id)
    note = f" (attempt {status.attempts}; the stack resumes it)" if status.resumes else ""
    if as_json:
        print(_json(_status_view(status)))
    else:
        print(f"{status.id}  {status.state}  {status.message or ''}{note}")
    if args.action == "wait":
        return 0 if status.state == "COMPLETED" else 1
    if args.action == "status":
        return 1 if status.final and status.state != "COMPLETED" else 0
    return 0


def _logs(jobs: object, args) -> int:  # noqa: ANN001
    """``jobs logs [--follow]``: the job's lines so far, or as they come until it ends."""
    from flowrl.infra.joblogs import LogReader, follow

    def show(line) -> None:  # noqa: ANN001
        print(_json(line.as_json()) if args.json else line.text(), flush=True)

    if not args.follow:
        jobs.status(args.run_id)  # type: ignore[attr-defined] # an unknown id: one line
        for line in LogReader(args.run_id).read():
            show(line)
        return 0
    status = follow(args.run_id, show, jobs=jobs)  # type: ignore[arg-type]
    return 0 if status.state == "COMPLETED" else 1


def _wait(jobs: object, args):  # noqa: ANN001, ANN202
    """``jobs wait``: on stderr, a live progress line on a terminal, the step lines when it is
    not one (none with --json); the final status."""
    from flowrl.infra.joblogs import Progress, follow

    live = sys.stderr.isatty()
    shown = [False]

    def show(line) -> None:  # noqa: ANN001
        progress = Progress.parse(line.message)
        if progress is None or args.json:
            return
        if live:
            sys.stderr.write(f"\r\033[K{progress.text()}")
        else:
            sys.stderr.write(f"{line.message}\n")
        sys.stderr.flush()
        shown[0] = True

    try:
        return follow(args.run_id, show, timeout=args.timeout, jobs=jobs)  # type: ignore[arg-type]
    finally:
        if live and shown[0]:
            sys.stderr.write("\n")


def _print_listing(jobs: object, args, as_json: bool) -> int:  # noqa: ANN001
    """``jobs list``, ``metrics`` and ``result``: lines for people, or one JSON document."""
    if args.action == "list":
        listed = jobs.list(limit=args.limit)  # type: ignore[attr-defined]
        lines = [
            f"{j.id}  {j.state:<10} {j.queue or '-':<10} {j.deployment or '-':<16} {j.name}"
            for j in listed
        ]
        _print(_json([_status_view(j) for j in listed]) if as_json else lines)
        return 0
    if args.action == "metrics":
        metrics = jobs.metrics(args.run_id)  # type: ignore[attr-defined]
        lines = [f"{key:<32} {value:.4f}" for key, value in sorted(metrics.items())]
        _print(_json(metrics) if as_json else lines)
        return 0
    result = jobs.result(args.run_id)  # type: ignore[attr-defined]
    if as_json:
        print(_json(result))
    else:
        print(result if result is not None else "no result (yet)")
    return 0 if result is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
