"""The environment service against hostile clients: the real service (``python -m
flowrl.environments.service``) on loopback with two owners' tokens and small limits. Every case
is refused with a 4xx (or handled), no file content is ever returned, and the service stays up;
memory after a flood of episodes returns to near where it started."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from services import start_env_service

ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef01"
LIMITS = ("--max-body-bytes", "65536", "--max-episodes-per-namespace", "40")
LIMITS += ("--max-bytes-per-namespace", "1000000", "--episode-ttl", "3")
TOOL_MATH = {"name": "tool_math", "params": {}}
ROW = {"question": "2*3=", "answer": "6"}
SECRET_MARKERS = ("root:", "AWS_", "PATH=", "/bin/", '"status"')


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[str, int]]:
    env = dict(os.environ, FLOWRL_ENV_SERVICE_KEYS=f"alice:{ALICE},bob:{BOB}")
    env["AWS_SECRET_ACCESS_KEY"] = "service-process-secret"
    url, proc = start_env_service(env=env, options=LIMITS)
    yield url, proc.pid
    proc.terminate()
    proc.wait(timeout=10)


def client(url: str, token: str | None = ALICE) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=30)


def reset(c: httpx.Client, episode: str, env=TOOL_MATH, row=ROW, job: str = "j") -> httpx.Response:
    return c.post("/reset", json={"job": job, "episode_id": episode, "env": env, "row": row})


def assert_refused(response: httpx.Response, *codes: int) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if codes:
        assert response.status_code in codes, (response.status_code, response.text[:300])
    assert "Traceback" not in response.text
    assert not any(m in response.text for m in SECRET_MARKERS), response.text[:300]


def assert_up(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# --- file and URL reads ---------------------------------------------------------------------------

PATHS = [
    "/etc/shadow",
    "/etc/passwd",
    "../../../../etc/passwd",
    "/proc/self/environ",
    "file:///etc/passwd",
    "http://127.0.0.1:1/",
    "https://example.org/a.png",
    "s3://bucket/key.png",
    "memory://x",
    "~/.aws/credentials",
    "\\\\server\\share\\x.png",
    "data:image/png;base64,AAAA",
]


@pytest.mark.parametrize("path", PATHS)
def test_a_path_or_url_in_a_row_is_never_opened(service, path):
    url, _ = service
    with client(url) as c:
        for cell in (path, {"path": path}, {"bytes": None, "path": path}):
            row = {"problem": "p", "answer": "1", "images": [cell]}
            assert_refused(reset(c, "geo", {"name": "geometry", "params": {}}, row), 400)
    assert_up(url)


def test_text_that_looks_like_a_path_is_just_text(service):
    url, _ = service
    with client(url) as c:
        answer = reset(c, "text", row={"question": "/etc/passwd", "answer": "1"})
    assert answer.status_code == 200 and answer.json()["observation"] == "/etc/passwd"


# --- tokens and ownership -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Basic YWxpY2U6eA==", f"Token {ALICE}", "Bearer wrong-token",
     f"Bearer {ALICE[:-1]}", f"bearer{ALICE}"],
)  # fmt: skip
def test_no_valid_bearer_token_is_401(service, header):
    url, _ = service
    headers = {"Authorization": header} if header is not None else {}
    for method, path in (("POST", "/reset"), ("POST", "/step"), ("GET", "/stats")):
        body = {"job": "j", "episode_id": "e", "action": "1"} if method == "POST" else None
        answer = httpx.request(method, f"{url}{path}", json=body, headers=headers)
        assert_refused(answer, 401)


def test_a_token_in_the_query_string_is_not_a_token(service):
    url, _ = service
    assert_refused(httpx.get(f"{url}/stats?token={ALICE}"), 401)


def test_another_owners_episode_cannot_be_stepped_deleted_seen_or_replaced(service):
    url, _ = service
    with client(url, ALICE) as alice, client(url, BOB) as bob:
        assert reset(alice, "mine", job="shared").status_code == 200
        step = {"job": "shared", "episode_id": "mine", "action": "1"}
        assert_refused(bob.post("/step", json=step), 404)
        assert_refused(bob.delete("/episodes/shared/mine"), 404)
        assert "shared" not in bob.get("/stats").json()["jobs"]
        assert reset(bob, "mine", job="shared").status_code == 200  # bob's own, separate
        assert alice.get("/stats").json()["jobs"]["shared"] == 1
        assert alice.post("/step", json=step).json()["done"] is True  # alice's is intact
        assert bob.delete("/episodes/shared/mine").json() == {"ended": True}


# --- body sizes -----------------------------------------------------------------------------------


def test_oversize_and_unsized_bodies_are_refused(service):
    url, _ = service
    with client(url) as c:
        big = {"job": "j", "episode_id": "e", "env": TOOL_MATH, "row": {"q": "x" * 100_000}}
        assert_refused(c.post("/reset", json=big), 413)
        assert_refused(c.post("/step", content=b"x" * 70_000), 413)
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as raw:  # a lying length
            auth = f"Authorization: Bearer {ALICE}\r\n".encode()
            raw.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\n" + auth)
            raw.sendall(b"Content-Length: 99999999999\r\n\r\n{}")
            assert raw.recv(100).startswith(b"HTTP/1.1 413")

        def chunks() -> Iterator[bytes]:
            yield b'{"job": "j", '
            yield b'"episode_id": "e", "action": "1"}'

        assert_refused(c.post("/step", content=chunks()), 411)  # chunked: no Content-Length
    assert_up(url)


def test_oversize_headers_close_the_connection_not_the_service(service):
    url, _ = service
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/stats", headers={"X-Fill": "a" * 200_000}, timeout=10).raise_for_status()
    assert_up(url)


# --- floods ---------------------------------------------------------------------------------------


def test_a_flood_of_episodes_hits_the_caps_and_memory_returns(service):
    url, pid = service
    start = rss_mb(pid)
    with client(url, ALICE) as alice, client(url, BOB) as bob:
        live = alice.get("/stats").json()["episodes"]  # left by earlier cases
        codes = [reset(alice, f"f{i}", job="flood").status_code for i in range(60)]
        room = 40 - live
        assert codes[:room] == [200] * room and set(codes[room:]) == {429}  # episode cap
        padded = {"question": "2*3=", "answer": "6", "pad": "x" * 60_000}
        codes = [reset(bob, f"b{i}", row=padded, job="flood").status_code for i in range(30)]
        assert 10 <= codes.count(200) <= 17 and codes[-1] == 429  # the 1 MB cap, not the 40
        peak = rss_mb(pid)
        time.sleep(4.5)  # past the 3 s idle TTL
        assert alice.get("/stats").json()["episodes"] == 0  # swept
        assert bob.get("/stats").json()["episodes"] == 0
        assert reset(alice, "after", job="flood").status_code == 200
    end = rss_mb(pid)
    print(f"service RSS: start {start:.1f} MB, peak {peak:.1f} MB, after expiry {end:.1f} MB")
    assert end - start < 50


# --- slow sockets ---------------------------------------------------------------------------------


def test_half_open_sockets_do_not_stop_the_service(service):
    url, _ = service
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(200):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")  # stalls
        sockets.append(s)
    try:
        assert_up(url)
        with client(url) as c:
            assert reset(c, "while-stalled").status_code == 200
    finally:
        for s in sockets:
            s.close()
    assert_up(url)


# --- CPU-heavy parameters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        ({"name": "tool_math", "params": {"eval_size": 10_000, "max_operand": 9}}, True),
        ({"name": "tool_math", "params": {"eval_size": 10_000, "max_operand": 9, "seed": 7}}, True),
        ({"name": "tool_math", "params": {"eval_size": 10**9}}, True),
        ({"name": "tool_math", "params": {"eval_size": 5000, "max_operand": 60}}, True),
        ({"name": "gomoku", "params": {"size": 10**6}}, True),
        ({"name": "gomoku", "params": {"eval_size": 10**9}}, True),
        ({"name": "arithmetic", "params": {"max_operand": 10**100, "eval_size": 10**9}}, False),
    ],
)
def test_cpu_heavy_params_are_refused_or_handled_quickly(service, env, refused):
    """Refused at once when the problem space cannot hold the eval set, or handled cheaply (the
    arithmetic task indexes its space and builds no eval set to serve an episode)."""
    url, _ = service
    with client(url) as c:
        row = ROW if env["name"] != "gomoku" else {"seed": 1}
        began = time.monotonic()
        answer = reset(c, "cpu", env=env, row=row)
        took = time.monotonic() - began
    if refused:
        assert_refused(answer, 400)
    else:
        assert answer.status_code == 200
    assert took < 2.0, took


def test_a_number_beyond_the_json_digit_limit_is_400(service):
    url, _ = service
    body = b'{"job": "j", "episode_id": "e", "env": {"name": "tool_math", "params": '
    body += b'{"min_operand": ' + b"9" * 5000 + b'}}, "row": {}}'
    with client(url) as c:
        assert_refused(c.post("/reset", content=body, headers={"Content-Type": "application/json"}))


# --- malformed requests ---------------------------------------------------------------------------

MALFORMED = [
    b"",
    b"{",
    b"[]",
    b"null",
    b"42",
    b'"text"',
    b"\xff\xfe\x00",
    b'{"job": "j"}',
    b'{"job": 1, "episode_id": 2, "env": 3, "row": 4}',
    b'{"job": "j", "episode_id": "e", "env": {"name": "tool_math"}, "row": []}',
    b'{"job": "j", "episode_id": "e", "env": {"name": null}, "row": {}}',
    b'{"job": "", "episode_id": "", "env": {"name": "tool_math"}, "row": {}}',
    b'{"job": "j", "episode_id": "e", "env": {"name": "tool_math", "params": []}}',
    b'{"job": "j", "episode_id": "e", "env": {"name": "tool_math"}, "row": {"question": 1}}',
    b'{"job": "j", "episode_id": "e", "env": {"name": "tool_math"}, "row": {"x": 1}}',
    b'{"job": "j", "episode_id": "e", "env": {"name": "../../etc/passwd"}, "row": {}}',
    b'{"job": "j", "episode_id": "e", "env": {"name": "os:system"}, "row": {}}',
    b'{"job": "j", "episode_id": "e", "env": {"name": "tool_math", "params": {"bogus": 1}}}',
    b'{"job": "' + b"j" * 5000 + b'", "episode_id": "e", "env": {"name": "tool_math"}}',
    b"[" * 30_000 + b"]" * 30_000,
    b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    b'{"job": "j", "episode_id": "e", "env": {"name": "tool_math"}, "row": NaN}',
    b'{"job": "j", "episode_id": "e", "env": {"name": "tool_math", "params": {"seed": 1e999}}}',
    b'{"job": "\\ud800", "episode_id": "e", "env": {"name": "tool_math"}, "row": {}}',
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_reset_bodies_are_4xx(service, body):
    url, _ = service
    with client(url) as c:
        assert_refused(c.post("/reset", content=body, headers={"Content-Type": "application/json"}))
    assert_up(url)


@pytest.mark.parametrize(
    "body",
    [b"{}", b'{"job": "j"}', b'{"job": "j", "episode_id": "e"}', b'{"action": 5}', b"\x00" * 10,
     b'{"job": "j", "episode_id": "nope", "action": "1"}'],
)  # fmt: skip
def test_malformed_step_bodies_are_4xx(service, body):
    url, _ = service
    with client(url) as c:
        assert_refused(c.post("/step", content=body, headers={"Content-Type": "application/json"}))
