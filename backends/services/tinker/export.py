"""Weights out of the Tinker service: ``save_weights_external`` writes a model's adapter as a
PEFT folder (``adapter_model.safetensors`` + ``adapter_config.json``, what ``PeftModel``
and the cookbook's merge read), optionally age-encrypted to the caller's recipients, as the
checkpoint ``tinker://<run>/external_weights/<name>``; ``get_external_weights_urls`` signs a
download URL per file.

A signed URL is the service's own (``GET /api/v1/external_weights/<token>``, no key: the token
is the permission): an HMAC of the namespace, checkpoint, file and expiry under a secret drawn
when the service starts, valid for an hour. A restarted service signs anew; the SDK asks
again when its URLs are about to expire."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request, Response

from flowrl.backends.models.tinker_checkpoints import run_folder
from flowrl.backends.policy.tinker_handles import ModelHandle
from flowrl.backends.services.tinker.checkpoints import Checkpoints
from flowrl.backends.services.tinker.state import Model
from flowrl.infra.serving import ServiceError

KIND = "external_weights"
URL_TTL_S = 3600
MAX_RECIPIENTS = 10
_TARGET = re.compile(r"\.([A-Za-z0-9_]+)\.lora_A\.weight$")


def peft_config(model: Model, keys: list[str]) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` of ``model``'s adapter, whose weights are ``keys``
    (its target modules are those the weights name: a base without some of the adapter's
    modules has none of their weights)."""
    targets = sorted({m[1] for k in keys if (m := _TARGET.search(k))})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": model.lora.r,
        "lora_alpha": model.lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "base_model_name_or_path": model.base_model,
    }


def _recipients(raw: Any) -> list[Any]:
    """The caller's age recipients (``age1…`` keys or SSH public keys), parsed: a malformed
    one is a 400 naming it."""
    import pyrage

    if raw is None:
        return []
    if len(raw) > MAX_RECIPIENTS:
        raise ServiceError(400, f"at most {MAX_RECIPIENTS} age_encryption_recipients")
    out = []
    for text in raw:
        try:
            if text.startswith("age1"):
                out.append(pyrage.x25519.Recipient.from_str(text))
            else:
                out.append(pyrage.ssh.Recipient.from_str(text))
        except Exception:  # noqa: BLE001 - pyrage raises its own types; all mean "bad key"
            raise ServiceError(400, f"not an age recipient: {text[:60]!r}") from None
    return out


class Exports:
    """Saves external weights (on the model's worker, as every save) and serves their files
    by signed URL."""

    def __init__(self, checkpoints: Checkpoints):
        self.checkpoints = checkpoints
        self.storage = checkpoints.storage
        self.registry = checkpoints.registry
        self._secret = secrets.token_bytes(32)

    def save(self, model: Model, name: str, ttl: Any, recipients_raw: Any) -> str:
        """Queue the export of ``model``'s adapter as ``external_weights/<name>``; the future's
        id."""
        recipients = _recipients(recipients_raw)
        folder, path = self.checkpoints.new_folder(model, KIND, name, ttl, overwrite=True)

        def work(handle: ModelHandle) -> dict:
            from safetensors.torch import load

            adapter = handle.call("state_bytes", False)["adapter.safetensors"]
            config = peft_config(model, sorted(load(adapter)))
            files = {
                "adapter_model.safetensors": adapter,
                "adapter_config.json": (json.dumps(config, indent=2) + "\n").encode(),
            }
            if recipients:
                import pyrage

                files = {f"{k}.age": pyrage.encrypt(v, recipients) for k, v in files.items()}
            size = self.checkpoints.write(model, KIND, folder, path, files, ttl)
            return {"path": path, "size_bytes": size, "type": "save_weights_external"}

        return self.registry.run_on(model, "save", work)

    # ---------------------------------------------------------------- signed downloads

    def urls(self, namespace: str | None, run_id: str, name: str, base: str) -> dict[str, Any]:
        """A signed URL per file of the caller's ``external_weights/<name>`` of ``run_id``,
        and when they expire."""
        path = f"tinker://{run_id}/{KIND}/{name}"
        _, kind, folder = self.checkpoints.parse_path(namespace, path)
        if kind != KIND:
            raise ServiceError(400, f"{path} is not an external_weights checkpoint")
        expires = int(time.time()) + URL_TTL_S
        urls = {}
        for file in self.storage.list(folder):
            if file != "checkpoint.json":
                token = self._sign([namespace, run_id, name, file, expires])
                urls[file] = f"{base.rstrip('/')}/api/v1/external_weights/{token}"
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}

    def read(self, token: str) -> bytes:
        """The file a signed token names (403 if its signature is wrong or it expired)."""
        namespace, run_id, name, file, expires = self._verify(token)
        if time.time() > expires:
            raise ServiceError(403, "this download URL has expired: ask for new URLs")
        self.checkpoints.parse_path(namespace, f"tinker://{run_id}/{KIND}/{name}")
        folder = f"{run_folder(namespace, run_id)}/{KIND}/{name}"
        if file == "checkpoint.json" or not self.storage.exists(f"{folder}/{file}"):
            raise ServiceError(404, "no such file")
        return self.storage.read_bytes(f"{folder}/{file}")

    def _sign(self, fields: list[Any]) -> str:
        body = base64.urlsafe_b64encode(json.dumps(fields).encode()).decode().rstrip("=")
        mac = hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()
        return f"{body}.{mac}"

    def _verify(self, token: str) -> list[Any]:
        body, _, mac = token.partition(".")
        good = hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()
        if not mac or not hmac.compare_digest(mac, good):
            raise ServiceError(403, "this download URL is not valid here")
        return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


def export_routes(app: FastAPI, exports: Exports, api: str) -> None:
    """``GET …/external_weights_urls`` (a key's) and the signed downloads (no key)."""

    @app.get(f"{api}/training_runs/{{run_id}}/checkpoints/{KIND}/{{name}}/external_weights_urls")
    async def external_urls(request: Request, run_id: str, name: str) -> dict:
        ns, base = request.state.namespace, str(request.base_url)
        return await asyncio.to_thread(exports.urls, ns, run_id, name, base)

    @app.get(f"{api}/external_weights/{{token}}")
    async def download(token: str) -> Response:
        data = await asyncio.to_thread(exports.read, token)
        return Response(data, media_type="application/octet-stream")
