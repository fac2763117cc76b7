"""The token of the Ray clusters flowrl starts (Ray 2.60 turns token authentication on for every
new local cluster).

Ray makes its default token (``~/.ray/auth_token``) the first time a cluster starts without one,
by writing the file: on a fresh machine two clusters starting at once (two jobs, a job beside a
``ray start --head``) each wrote a token of their own, the last write won, and the other
cluster's later processes (its workers, a driver connecting to it) read a token it refused.
``ensure_token`` makes the file once, atomically, before a cluster starts: whoever wins, every
process reads the same token.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def default_token() -> Path:
    """Where Ray looks for its token when neither ``RAY_AUTH_TOKEN`` nor ``RAY_AUTH_TOKEN_PATH``
    is set."""
    return Path.home() / ".ray" / "auth_token"


def write_token_once(path: Path) -> None:
    """A new random token at ``path`` (mode 0600), unless one is there already; atomic: of
    processes racing to make it, one token wins and all read it."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        with contextlib.suppress(FileExistsError):  # another process made it first: keep theirs
            os.link(draft, path)
    finally:
        draft.unlink()


def ensure_token() -> None:
    """Before starting a local Ray cluster: make Ray's default token where the cluster will use
    it (``write_token_once``). Nothing where the environment names a token (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH``) or turns token authentication off (``RAY_AUTH_MODE``)."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return
    write_token_once(default_token())
