"""The ``flowrl`` command line.

    flowrl train [CONFIG.yaml] [--set key=value ...] [--verbose]

Validates the config before anything starts (a bad field fails at once, naming the field),
then runs the ``rl-train`` flow in this process and prints the result.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="Run an RL training job (the rl-train flow).")
    train.add_argument("config", nargs="?", help="YAML job config; omitted = embedded defaults.")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a config field, e.g. --set schedule.steps=50 (repeatable).",
    )
    train.add_argument("--verbose", action="store_true", help="Show Prefect's INFO logs.")
    show = sub.add_parser("config", help="Print the validated config (defaults filled in).")
    show.add_argument("config", nargs="?")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from infra.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"flowrl: {err}", file=sys.stderr)
        return 2
    if args.command == "config":
        import yaml

        print(yaml.safe_dump(config.model_dump(), sort_keys=False))
        return 0
    return _train(config, verbose=args.verbose)


def _train(config, verbose: bool) -> int:
    if not verbose:
        # Keep the terminal for the progress bar; the logs still reach the Prefect API.
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from infra.settings import get_settings

    get_settings().apply_to_environment()
    from flows.rl import rl_train

    result = rl_train(config)
    print()
    print(f"held-out accuracy at the start of RL : {result.accuracy_start:.3f}")
    print(f"held-out accuracy at the end         : {result.accuracy_end:.3f}")
    print(f"registered model                     : {result.model_uri}")
    print(f"MLflow run                           : {result.mlflow_run_id}")
    print(f"MLflow tracking URI                  : {get_settings().tracking_uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
