"""Secrets out of records: what flowrl writes about a job (MLflow params and tags, ``job.json``,
``result.json``, registry descriptions) passes through ``redact`` first.

- The user-info of any URL in a string (``https://alice:token@host/…``) becomes ``***``.
- The value of a secret-named key (``api_token``, ``password``, ``aws_secret_access_key`` …)
  becomes ``***``; the key itself stays, so the recorded params still list every config field.
  Names are matched by whole words: ``max_new_tokens`` is no secret.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s?#]+@")
_SECRET_WORDS = frozenset(
    {"secret", "password", "passwd", "passphrase", "token", "credential", "credentials", "auth"}
    | {"authorization", "apikey", "cookie"}
)
_SECRET_PAIRS = ("api_key", "access_key", "private_key", "secret_key")


def redact_text(text: str) -> str:
    """``text`` with the user-info of every URL in it replaced by ``***``."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)


def is_secret_key(key: str) -> bool:
    """Whether a field named ``key`` holds a secret (whole words of the name, any case)."""
    lowered = key.lower()
    words = set(re.split(r"[^a-z0-9]+", lowered))
    return bool(words & _SECRET_WORDS) or any(pair in lowered for pair in _SECRET_PAIRS)


def redact(obj: Any) -> Any:
    """A copy of a JSON-like ``obj`` with secret-named values and URL user-info replaced."""
    if isinstance(obj, dict):
        return {
            k: REDACTED if is_secret_key(str(k)) and obj[k] not in (None, "") else redact(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj
