"""The serving layer every flowrl HTTP service shares (``infra.serving``): keys → namespaces,
loopback-only without keys, body-size and rate limits, errors as ``{"detail": …}``; and the
environment service's old flag and variable names still working, with a warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from services import start_env_service

from flowrl.infra.serving import (
    Keys,
    RateLimiter,
    ServiceError,
    ServingLimits,
    body_size_refusal,
    check_exposure,
    guarded_app,
    parse_key_entries,
    presented_key,
    read_keys,
)

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef01"
REPO = Path(__file__).resolve().parents[1]


def test_keys_map_to_namespaces_and_unknown_or_missing_keys_are_401() -> None:
    keys = Keys({ALICE: "alice", BOB: "bob"})
    assert keys.namespace_of(ALICE) == "alice" and keys.namespace_of(BOB) == "bob"
    for wrong in (None, "", ALICE[:-1], ALICE + "x", BOB.upper()):
        with pytest.raises(ServiceError) as caught:
            keys.namespace_of(wrong)
        assert caught.value.status == 401
    assert Keys().namespace_of(None) is None  # no keys: every caller one owner
    assert not Keys() and Keys({ALICE: "alice"})


def test_a_key_is_presented_as_x_api_key_or_bearer_and_nowhere_else() -> None:
    assert presented_key({"x-api-key": ALICE}) == ALICE
    assert presented_key({"authorization": f"Bearer {ALICE}"}) == ALICE
    assert presented_key({"authorization": f"bearer  {ALICE} "}) == ALICE
    for header in ("", "Bearer", "Bearer ", f"Basic {ALICE}", f"Token {ALICE}", f"bearer{ALICE}"):
        assert presented_key({"authorization": header}) is None, header


def test_key_entries_name_what_is_wrong_without_the_key(monkeypatch, tmp_path) -> None:
    assert parse_key_entries([f"alice:{ALICE}", f" bob:{BOB} "]) == {ALICE: "alice", BOB: "bob"}
    for entry, says in (
        (f"Alice:{ALICE}", "namespace of a-z"),
        (ALICE, "namespace of a-z"),
        ("alice:short", r"16\+ characters"),
    ):
        with pytest.raises(SystemExit, match=says) as caught:
            parse_key_entries([entry])
        assert ALICE not in str(caught.value)
    with pytest.raises(SystemExit, match="'tml-'"):
        parse_key_entries([f"alice:{ALICE}"], key_prefix="tml-")
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# team keys\nalice:{ALICE}\n\n")
    monkeypatch.setenv("NEW_KEYS", f"bob:{BOB}")
    assert read_keys(str(keys_file), ["NEW_KEYS"]) == {ALICE: "alice", BOB: "bob"}


def test_without_keys_a_service_serves_loopback_only_and_only_when_asked() -> None:
    check_exposure("0.0.0.0", {ALICE: "alice"}, insecure_loopback=False)  # keys: anywhere
    check_exposure("127.0.0.1", {}, insecure_loopback=True)
    check_exposure("localhost", {}, insecure_loopback=True)
    check_exposure("::1", {}, insecure_loopback=True)
    with pytest.raises(SystemExit, match="no keys"):
        check_exposure("127.0.0.1", {}, insecure_loopback=False)
    for host in ("0.0.0.0", "10.0.0.1", "example.org"):
        with pytest.raises(SystemExit, match="loopback addresses only"):
            check_exposure(host, {}, insecure_loopback=True)


def test_body_size_refusals() -> None:
    assert body_size_refusal("GET", None, 10) is None
    assert body_size_refusal("POST", None, 10) == (411, "a request body needs a Content-Length")
    assert body_size_refusal("POST", "11", 10)[0] == 413
    assert body_size_refusal("PUT", "-1", 10)[0] == 413
    assert body_size_refusal("PATCH", "10", 10) is None


def test_the_rate_limit_is_a_bucket_per_namespace() -> None:
    now = [0.0]
    limiter = RateLimiter(2.0, clock=lambda: now[0])
    assert [limiter.allow("a") for _ in range(3)] == [True, True, False]
    assert limiter.allow("b")  # another namespace has its own bucket
    now[0] = 0.5  # one request's worth refilled
    assert limiter.allow("a") and not limiter.allow("a")
    assert all(RateLimiter(0).allow("a") for _ in range(1000))  # 0: no limit


def _app(limits: ServingLimits) -> TestClient:
    app = guarded_app("t", Keys({ALICE: "alice", BOB: "bob"}), limits, open_paths={"/health"})

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/echo")
    def echo(body: dict) -> dict:
        if body.get("fail"):
            raise ServiceError(409, "refused by the route")
        return body

    return TestClient(app)


def test_the_guard_answers_every_refusal_as_detail_and_serves_on() -> None:
    client = _app(ServingLimits(max_body_bytes=64))
    assert client.get("/health").json() == {"status": "ok"}  # open: no key
    unknown = client.post("/echo", json={}, headers={"X-API-Key": "nope-0123456789abcdef"})
    assert unknown.status_code == 401 and set(unknown.json()) == {"detail"}
    big = client.post("/echo", json={"x": "y" * 100}, headers={"X-API-Key": ALICE})
    assert big.status_code == 413 and "64 bytes" in big.json()["detail"]
    bad = client.post("/echo", content=b"[1]", headers={"X-API-Key": ALICE})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("malformed request")
    refused = client.post("/echo", json={"fail": 1}, headers={"Authorization": f"Bearer {BOB}"})
    assert refused.status_code == 409 and refused.json() == {"detail": "refused by the route"}
    assert client.post("/echo", json={"a": 1}, headers={"X-API-Key": BOB}).json() == {"a": 1}
    assert client.get("/health").status_code == 200


def test_the_rate_limit_refuses_a_namespace_over_it_and_not_the_others() -> None:
    client = _app(ServingLimits(max_requests_per_s=1))  # a burst of one request a namespace
    assert client.post("/echo", json={}, headers={"X-API-Key": ALICE}).status_code == 200
    over = client.post("/echo", json={}, headers={"X-API-Key": ALICE})
    assert over.status_code == 429 and "1 requests a second" in over.json()["detail"]
    assert client.post("/echo", json={}, headers={"X-API-Key": BOB}).status_code == 200
    assert client.get("/health").status_code == 200  # open paths are not counted


def test_the_environment_service_keeps_its_old_names_with_a_warning(tmp_path) -> None:
    """``--tokens-file``, ``FLOWRL_ENV_SERVICE_TOKENS`` and ``--max-episodes-per-owner`` still
    work; ``python -m flowrl.environments.service`` still starts it; each says what replaces it."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\n")
    env = dict(os.environ, FLOWRL_ENV_SERVICE_TOKENS=f"bob:{BOB}")
    url, proc = start_env_service(
        env=env, options=("--tokens-file", str(tokens), "--max-episodes-per-owner", "1")
    )
    try:
        row = {"question": "2*3=", "answer": "6"}
        body = {"job": "j", "episode_id": "e", "env": {"name": "tool_math"}, "row": row}
        for key in (ALICE, BOB):
            answer = httpx.post(f"{url}/reset", json=body, headers={"X-API-Key": key})
            assert answer.status_code == 200, answer.text
        again = dict(body, episode_id="f")
        full = httpx.post(f"{url}/reset", json=again, headers={"X-API-Key": ALICE})
        assert full.status_code == 429 and "at most 1 live episodes" in full.json()["detail"]
        assert httpx.get(f"{url}/stats").status_code == 401
    finally:
        proc.terminate()
        proc.wait(10)
    old = subprocess.run(
        [sys.executable, "-m", "flowrl.environments.service", "--tokens-file", str(tokens),
         "--port", "1", "--host", "0.0.0.0", "--step-timeout", "0"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert old.returncode != 0
    assert "use flowrl serve environments" in old.stderr
    assert "--tokens-file is deprecated; use --keys-file" in old.stderr
    assert "--step-timeout must be > 0" in old.stderr
