"""The token of the Ray clusters flowrl starts: made once, atomically, so that clusters starting
at once on a fresh machine all use the one token (``infra.ray_auth``)."""

from __future__ import annotations

import stat

import pytest
from races import race

from flowrl.infra import ray_auth

MAKE = """
from pathlib import Path
from flowrl.infra.ray_auth import write_token_once
path = Path(sys.argv[3])
write_token_once(path)
print(path.read_text())
"""


def test_processes_racing_to_make_the_token_all_read_one(tmp_path):
    path = tmp_path / ".ray" / "auth_token"
    read = race(MAKE, 8, tmp_path / "race", (str(path),))
    token = path.read_text()
    assert {out.strip() for out in read} == {token}  # every racer read the one token kept
    assert len(token) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["auth_token"]  # no drafts left
    ray_auth.write_token_once(path)
    assert path.read_text() == token  # an existing token is kept


@pytest.mark.parametrize(
    "env",
    [
        {"RAY_AUTH_TOKEN_PATH": "/elsewhere/token"},
        {"RAY_AUTH_TOKEN": "abc"},
        {"RAY_AUTH_MODE": "disabled"},
    ],
)
def test_a_token_named_or_auth_turned_off_leaves_the_default_alone(env, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ray_auth.ensure_token()
    assert not (tmp_path / ".ray").exists()
    for key in env:
        monkeypatch.delenv(key)
    ray_auth.ensure_token()
    assert len((tmp_path / ".ray" / "auth_token").read_text()) == 64
