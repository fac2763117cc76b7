"""The stack's PostgreSQL runs as a system user that the first stack on a machine makes (as
root): stacks starting at once must all find the one user (``infra.postgres``)."""

from __future__ import annotations

import os
import pwd
import secrets
import subprocess

from races import race

ENSURE = """
import pwd
from flowrl.infra.postgres import _ensure_system_user
_ensure_system_user(sys.argv[3])
print(pwd.getpwnam(sys.argv[3]).pw_uid)
"""


def test_stacks_starting_at_once_all_find_the_one_system_user(tmp_path):
    assert os.geteuid() == 0, "the stack makes its server's user as root (CI runs as root)"
    name = f"flowrl-test-{secrets.token_hex(3)}"
    try:
        uids = race(ENSURE, 4, tmp_path, (name,))
        assert {int(uid) for uid in uids} == {pwd.getpwnam(name).pw_uid}  # one user for all
        with open("/etc/passwd") as passwd:
            assert sum(line.startswith(f"{name}:") for line in passwd) == 1
    finally:
        subprocess.run(["userdel", name], capture_output=True)
