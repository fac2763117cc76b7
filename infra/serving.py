"""The serving layer every flowrl HTTP service shares: the Tinker API, the environment service,
and whatever comes next.

One vocabulary: a caller presents an API **key** (``X-API-Key: <key>``, or ``Authorization:
Bearer <key>``); the service maps it to a **namespace** (``[a-z0-9][a-z0-9-]{0,31}``), compared
in constant time against sha256 digests (the keys themselves are not kept). Keys come from a
keys file (lines ``namespace:key``, ``#`` comments) or an environment variable
(``namespace:key,namespace:key``), never from a request or a job config. Without keys a service
starts only with ``--insecure-loopback`` on a loopback address, and every caller is one owner
(namespace None).

``guarded_app`` builds the FastAPI app with the shared guard in front of every route, in this
order: body size (a POST/PUT/PATCH without Content-Length: 411, over the limit: 413), the key
(401; open paths such as health checks skip it), the namespace's request rate (429). Errors are
``{"detail": "<one line>"}``: a ``ServiceError`` raised anywhere answers its status, a request
that does not validate answers 422 naming the field. ``serve`` runs an app under uvicorn with the
same connection limits for every service, and ``add_serving_arguments`` gives every ``flowrl
serve <name>`` the same flags.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import os
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # FastAPI is imported when an app is built: a command's flags cost no import
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import JSONResponse

Handler = Callable[["Request"], Awaitable["Response"]]
NAMESPACE_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
MIN_KEY_CHARS = 16


class ServiceError(Exception):
    """An answer with an HTTP status and a one-line message (``{"detail": message}``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_response(status: int, detail: str) -> JSONResponse:
    """Every refusal of every service: ``{"detail": …}`` with its status."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"detail": detail}, status_code=status)


# ------------------------------------------------------------------------------------ keys


def key_digest(key: str) -> bytes:
    """What keys are compared by: equal-length digests, compared in constant time."""
    return hashlib.sha256(key.encode()).digest()


class Keys:
    """API key → namespace. Empty: no authentication (every caller namespace None)."""

    def __init__(self, keys: dict[str, str] | None = None) -> None:
        self._by_digest = {key_digest(k): ns for k, ns in (keys or {}).items()}

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def namespace_of(self, key: str | None) -> str | None:
        """The caller's namespace; ``ServiceError(401)`` for a missing or unknown key."""
        if not self._by_digest:
            return None
        if not key:
            raise ServiceError(401, "missing API key (X-API-Key or Authorization: Bearer)")
        digest = key_digest(key)
        found = None
        for known, namespace in self._by_digest.items():  # no early exit: constant time
            if hmac.compare_digest(known, digest):
                found = namespace
        if found is None:
            raise ServiceError(401, "unknown API key")
        return found


def presented_key(headers: Any) -> str | None:
    """The key a request presents: ``X-API-Key``, else ``Authorization: Bearer``."""
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def parse_key_entries(entries: Iterable[str], key_prefix: str = "") -> dict[str, str]:
    """``namespace:key`` entries → {key: namespace}; ``SystemExit`` naming a bad entry (never
    the key itself)."""
    keys: dict[str, str] = {}
    for n, entry in enumerate(entries, 1):
        namespace, sep, key = entry.strip().partition(":")
        if not sep or not NAMESPACE_PATTERN.fullmatch(namespace):
            raise SystemExit(
                f"key entry {n}: must be namespace:key with a namespace of a-z, 0-9 and - "
                "(32 characters at most)"
            )
        if not key.startswith(key_prefix) or len(key) < MIN_KEY_CHARS + len(key_prefix):
            raise SystemExit(
                f"key entry {n} ({namespace}): a key must start with {key_prefix!r} and have "
                f"{MIN_KEY_CHARS + len(key_prefix)}+ characters"
                if key_prefix
                else f"key entry {n} ({namespace}): a key needs {MIN_KEY_CHARS}+ characters"
            )
        keys[key] = namespace
    return keys


def read_keys(
    path: str | None, variables: Iterable[str], key_prefix: str = "", deprecated: Iterable[str] = ()
) -> dict[str, str]:
    """{key: namespace} from a keys file and the first set variable of ``variables``, then of
    ``deprecated`` (old names, read with a warning on stderr)."""
    entries: list[str] = []
    if path:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        entries += [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    for name in variables:
        entries += [e for e in os.environ.get(name, "").split(",") if e.strip()]
    current = list(variables)
    for name in deprecated:
        value = os.environ.get(name, "")
        if value.strip():
            print(f"warning: {name} is deprecated; set {current[0]} instead", file=sys.stderr)
            entries += [e for e in value.split(",") if e.strip()]
    return parse_key_entries(entries, key_prefix)


def check_exposure(host: str, keys: dict[str, str], insecure_loopback: bool) -> None:
    """A service without keys serves loopback only, and only when asked to
    (``--insecure-loopback``); ``SystemExit`` naming why otherwise."""
    if keys:
        return
    if not insecure_loopback:
        raise SystemExit(
            "no keys: give --keys-file or the keys variable, or --insecure-loopback on a "
            "loopback address"
        )
    try:
        loopback = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"--insecure-loopback serves loopback addresses only, not {host}")


# ---------------------------------------------------------------------------------- limits


@dataclass
class ServingLimits:
    """What every service refuses before a route runs."""

    max_body_bytes: int = 2**20
    max_requests_per_s: float = 0.0
    """Requests a namespace may make per second, averaged over a burst of as many (0: no limit)."""


def body_size_refusal(
    method: str, content_length: str | None, max_bytes: int
) -> tuple[int, str] | None:
    """Why a request's body is refused before it is read, as (status, message): a POST, PUT or
    PATCH without a Content-Length (411) or over ``max_bytes`` (413); None when acceptable."""
    if method not in ("POST", "PUT", "PATCH"):
        return None
    if content_length is None:
        return 411, "a request body needs a Content-Length"
    if not content_length.isdigit() or int(content_length) > max_bytes:
        return 413, f"request body over {max_bytes} bytes"
    return None


class RateLimiter:
    """A token bucket per namespace: ``rate`` requests a second, bursts of ``rate``."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self._buckets: dict[str | None, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def allow(self, namespace: str | None) -> bool:
        if self.rate <= 0:
            return True
        now = self.clock()
        with self._lock:
            tokens, then = self._buckets.get(namespace, (self.rate, now))
            tokens = min(self.rate, tokens + (now - then) * self.rate)
            if tokens < 1:
                self._buckets[namespace] = (tokens, now)
                return False
            self._buckets[namespace] = (tokens - 1, now)
            return True


# ------------------------------------------------------------------------------------- app


def guarded_app(
    title: str,
    keys: Keys,
    limits: ServingLimits,
    open_paths: Iterable[str] = (),
    on_request: Callable[[], None] | None = None,
    open_prefixes: tuple[str, ...] = (),
) -> FastAPI:
    """A FastAPI app behind the shared guard; a route reads the caller's namespace as
    ``request.state.namespace`` (None without keys, and on ``open_paths`` and the paths under
    ``open_prefixes``, whose routes check a permission of their own)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    app = FastAPI(title=title)
    open_set = frozenset(open_paths)
    rate = RateLimiter(limits.max_requests_per_s)

    @app.middleware("http")
    async def guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        refusal = body_size_refusal(
            request.method, request.headers.get("content-length"), limits.max_body_bytes
        )
        if refusal is not None:
            return error_response(*refusal)
        request.state.namespace = None
        path = request.url.path
        if path not in open_set and not (open_prefixes and path.startswith(open_prefixes)):
            try:
                request.state.namespace = keys.namespace_of(presented_key(request.headers))
            except ServiceError as e:
                return error_response(e.status, str(e))
            if not rate.allow(request.state.namespace):
                return error_response(429, f"over {limits.max_requests_per_s:g} requests a second")
        if on_request is not None:
            on_request()
        try:
            return await call_next(request)
        except ServiceError as e:  # raised under a middleware of the app's own
            return error_response(e.status, str(e))

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> Response:
        return error_response(exc.status, str(exc))

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(
            422, f"malformed request: {where}: {first.get('msg', 'invalid')}"[:300]
        )

    return app


# ------------------------------------------------------------------------ command and run


def add_serving_arguments(
    parser: argparse.ArgumentParser, port: int, keys_variable: str, max_body_bytes: int
) -> None:
    """The flags every ``flowrl serve <name>`` takes."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--keys-file", help=f"lines namespace:key (or {keys_variable})")
    parser.add_argument(
        "--insecure-loopback",
        action="store_true",
        help="serve without keys (every caller one owner); loopback addresses only",
    )
    parser.add_argument("--max-body-bytes", type=int, default=max_body_bytes)
    parser.add_argument(
        "--max-requests-per-second",
        type=float,
        default=0.0,
        help="requests one namespace may make per second (0: no limit)",
    )


def serving_limits(args: argparse.Namespace) -> ServingLimits:
    """The shared limits from ``add_serving_arguments``' flags."""
    if args.max_body_bytes <= 0:
        raise SystemExit(f"--max-body-bytes must be > 0, got {args.max_body_bytes}")
    if args.max_requests_per_second < 0:
        raise SystemExit(
            f"--max-requests-per-second must be >= 0, got {args.max_requests_per_second}"
        )
    return ServingLimits(args.max_body_bytes, args.max_requests_per_second)


def serve(app: FastAPI, host: str, port: int, keep_alive_s: int = 5) -> None:
    """Run ``app`` under uvicorn with the connection limits every service shares."""
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        limit_concurrency=512,
        backlog=512,
        timeout_keep_alive=keep_alive_s,
        h11_max_incomplete_event_size=64 * 1024,
    )


class BackgroundServer:
    """``app`` under uvicorn on a free loopback port, in a daemon thread of this process (a
    rollout's sessions, tests); ``stop()`` ends it. Loopback only: nothing else may reach it."""

    def __init__(self, app: FastAPI, start_timeout_s: float = 30.0) -> None:
        import uvicorn

        from flowrl.infra.servers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            limit_concurrency=1024,
            backlog=1024,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="uvicorn")
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                BackgroundServer.stop(self)
                raise RuntimeError(f"a server on {self.url} did not start")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
