"""The stack's PostgreSQL runs as a system user that the first stack on a machine makes (as
root): stacks starting at once must all find the one user (``infra.postgres``)."""

from __future__ import annotations

import multiprocessing
import os
import pwd
import secrets
import subprocess

from flowrl.infra import postgres


def _ensure(
    name: str, start: multiprocessing.synchronize.Event, uids: multiprocessing.Queue
) -> None:
    start.wait()
    postgres._ensure_system_user(name)
    uids.put(pwd.getpwnam(name).pw_uid)


def test_stacks_starting_at_once_all_find_the_one_system_user():
    assert os.geteuid() == 0, "the stack makes its server's user as root (CI runs as root)"
    name = f"flowrl-test-{secrets.token_hex(3)}"
    context = multiprocessing.get_context("fork")
    start, uids = context.Event(), context.Queue()
    racers = [context.Process(target=_ensure, args=(name, start, uids)) for _ in range(4)]
    try:
        for racer in racers:
            racer.start()
        start.set()
        for racer in racers:
            racer.join(60)
        assert [r.exitcode for r in racers] == [0] * 4
        seen = {uids.get(timeout=5) for _ in racers}
        assert seen == {pwd.getpwnam(name).pw_uid}  # one user, the uid every process ran with
        entries = [line for line in open("/etc/passwd") if line.startswith(f"{name}:")]
        assert len(entries) == 1
    finally:
        subprocess.run(["userdel", name], capture_output=True)
