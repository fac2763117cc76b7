"""The ``flowrl`` command line's arguments (``flowrl --help``): every command and its flags.
What each command does is ``flowrl/cli.py``'s."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

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
        parser.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="Show the engines' own output too: Prefect's INFO logs, MLflow's and Ray's "
            "lines and progress bars.",
        )


class _Parser(argparse.ArgumentParser):
    """A wrong, missing or malformed argument is one line naming it and ``--help``, exit 2
    (argparse's default prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _positive(kind: type[int] | type[float], zero: bool = False) -> Callable[[str], int | float]:
    """An argument type: a number of ``kind`` over 0 (``zero``: at least 0)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text[:40]!r}") from None
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(
                f"must be {'0 or more' if zero else 'positive'}, got {text[:40]}"
            )
        return value

    return parse


def command_parser(description: str) -> argparse.ArgumentParser:
    """Every ``flowrl`` command, under ``description`` (the CLI module's first line)."""
    parser = _Parser(prog="flowrl", description=description)
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


JOBS_EXIT_CODES = """exit codes:
  0    done; for wait, status and logs --follow: the job COMPLETED
  1    the job ended FAILED, CRASHED or CANCELLED; or what was asked for is not there (no
       stack or a component of it down, an unknown or malformed id or deployment, no result
       yet); or the reader of the output left (a closed pipe)
  2    bad input: arguments, a config or parameters that do not fit the deployment, a job
       larger than the pool
  124  wait --timeout passed with the job still going (it goes on)
  130  Ctrl-C on wait or logs --follow: stopped following (the job goes on; `flowrl jobs
       cancel ID` stops it)"""
"""``flowrl jobs --help``'s epilog."""


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
        type=_positive(int, zero=True),
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
        epilog=JOBS_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    as_json = {"action": "store_true", "help": "Print JSON (one object) for scripts."}
    submit.add_argument("--json", **as_json)
    for verb, text in (
        ("status", "Print a job's state; exit 1 if it FAILED, CRASHED or was CANCELLED."),
        ("cancel", "Cancel a job."),
        ("metrics", "Print a finished job's latest MLflow metrics."),
        ("result", "Print a finished job's result."),
    ):
        verb_parser = jsub.add_parser(verb, help=text)
        verb_parser.add_argument(
            "run_id", help="Prefect flow-run id (printed by `jobs submit` and `jobs list`)."
        )
        if verb != "cancel":
            verb_parser.add_argument("--json", **as_json)
    wait = jsub.add_parser(
        "wait",
        help="Wait for a job to end, showing its progress (step, metrics, time left) on "
        "stderr: a live line on a terminal, the job's step lines otherwise; exit 1 unless it "
        "COMPLETED.",
    )
    wait.add_argument("run_id", help="Prefect flow-run id.")
    wait.add_argument(
        "--timeout", type=_positive(float), default=3600, help="Seconds to wait at most."
    )
    wait.add_argument("--json", **as_json)
    logs = jsub.add_parser(
        "logs",
        help="Print a job's log: its phases and a line per step with its metrics (reward, "
        "loss, s/step, accuracy where evaluated).",
    )
    logs.add_argument("run_id", help="Prefect flow-run id.")
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="Stream the lines as they come until the job ends; exit as `wait` does.",
    )
    logs.add_argument("--json", action="store_true", help="One JSON object per line.")
    listing = jsub.add_parser("list", help="List recent jobs with their state and queue.")
    listing.add_argument("--limit", type=_positive(int), default=20, help="Jobs to list.")
    listing.add_argument("--json", **as_json)
