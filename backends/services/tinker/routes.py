"""HTTP in front of the Tinker service: the routes the official ``tinker`` SDK calls
(``/api/v1/...``), each parsing its request with the SDK's own types, calling one verb of
``TinkerService`` and answering as the SDK expects. The serving layer (``infra.serving``) guards
every route but the health and client-config ones: key → namespace, body size, rate.

A request the service cannot serve (malformed JSON or protobuf, lengths that do not match, token
ids outside the vocabulary, an unknown loss, model, sampler or future, an oversized body) gets a
4xx ``{"detail": …}`` naming it; nothing a client sends answers 500.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from flowrl.backends.engines.tinker.types import (
    TinkerInputError,
    adam_step,
    check_sample_request,
    sample_params,
)
from flowrl.backends.services.tinker.checkpoints import checkpoint_view, run_view
from flowrl.backends.services.tinker.export import export_routes
from flowrl.backends.services.tinker.search import finish_status, search_sessions
from flowrl.backends.services.tinker.service import TinkerService
from flowrl.backends.services.tinker.wire import decompress, read_forward_backward
from flowrl.infra.serving import ServiceError, error_response, guarded_app

API = "/api/v1"
OPEN_PATHS = (f"{API}/healthz", f"{API}/client/config", f"{API}/client/dynamic_config")
NULL = b"null"
MAX_COPY_KEYS = 4096
"""``copy_weights`` idempotency keys remembered (a client sending new ones cannot grow it)."""


def create_app(service: TinkerService) -> FastAPI:
    """The service's HTTP API (see the module docstring)."""
    app = guarded_app(
        "flowrl Tinker API",
        service.keys,
        service.limits,
        open_paths=OPEN_PATHS,
        open_prefixes=(f"{API}/external_weights/",),  # signed downloads (export.py)
    )
    app.state.service = service

    @app.exception_handler(TinkerInputError)
    async def input_error(request: Request, exc: TinkerInputError) -> Response:
        return error_response(400, str(exc))

    for add in (
        _client_routes,
        _session_routes,
        _model_routes,
        _training_routes,
        _sampling_routes,
        _future_routes,
        _run_routes,
        _copy_routes,
    ):
        add(app, service)
    export_routes(app, service.exports, API)
    return app


def _parse(model: type[BaseModel], body: Any) -> Any:
    """The request as the SDK's type, or a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ServiceError(
            400, f"malformed {model.__name__}: {where}: {first.get('msg', 'invalid')}"[:300]
        ) from None


async def _body(request: Request) -> dict:
    """The request's JSON object (400 if it is not one)."""
    return _json(await request.body())


def _json(raw: bytes) -> dict:
    try:
        data = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ServiceError(400, "malformed JSON body") from None
    if not isinstance(data, dict):
        raise ServiceError(400, "the JSON body must be an object")
    return data


# ---------------------------------------------------------------- the verbs a journal replays
# Each takes the raw request (forward_backward's protobuf decompressed, else JSON) and answers
# its future; the service journals it first (``TinkerService.journaled``), and a restarted
# service calls it again with the same raw request (``TinkerService.recover``).


def forward_backward_verb(service: TinkerService, ns: str | None, raw: bytes) -> dict:
    call = read_forward_backward(raw)

    def answer() -> dict:
        return _future(*service.training.forward_backward(ns, call))

    return service.calls.journaled(ns, "forward_backward", call.model_id, call.seq_id, raw, answer)


def optim_step_verb(service: TinkerService, ns: str | None, raw: bytes) -> dict:
    from tinker import types as t

    req = _parse(t.OptimStepRequest, _json(raw))
    params = req.optim_params
    if not isinstance(params, t.AdamParams):
        kind = getattr(params, "type", "?")
        raise ServiceError(400, f"optimizer params {kind!r} are not supported (adam)")
    adam = adam_step(params)

    def answer() -> dict:
        return _future(*service.training.optim_step(ns, req.model_id, adam))

    return service.calls.journaled(ns, "optim_step", req.model_id, req.seq_id, raw, answer)


def save_weights_verb(service: TinkerService, ns: str | None, raw: bytes) -> dict:
    from tinker import types as t

    req = _parse(t.SaveWeightsRequest, _json(raw))

    def answer() -> dict:
        model = service.registry.model(ns, req.model_id)
        meta, ttl = req.user_metadata or {}, req.ttl_seconds
        rid = service.checkpoints.save(
            model, "weights", req.path, True, meta, ttl, overwrite=req.overwrite
        )
        return _future(rid, model.model_id)

    return service.calls.journaled(ns, "save_weights", req.model_id, req.seq_id, raw, answer)


def save_for_sampler_verb(service: TinkerService, ns: str | None, raw: bytes) -> dict:
    from tinker import types as t

    req = _parse(t.SaveWeightsForSamplerRequest, _json(raw))
    if req.kind != "snapshot":
        raise ServiceError(400, f"sampling client kind {req.kind!r} is not served (snapshot)")

    def answer() -> dict:
        if req.path is None:
            return _future(*service.sampling.snapshot_for_sampler(ns, req.model_id))
        model = service.registry.model(ns, req.model_id)
        meta = req.user_metadata or {}
        ttl = req.ttl_seconds
        rid = service.checkpoints.save(model, "sampler_weights", req.path, False, meta, ttl)
        return _future(rid, model.model_id)

    verb = "save_weights_for_sampler"
    return service.calls.journaled(ns, verb, req.model_id, req.seq_id, raw, answer)


def save_external_verb(service: TinkerService, ns: str | None, raw: bytes) -> dict:
    from tinker import types as t

    req = _parse(t.SaveWeightsExternalRequest, _json(raw))

    def answer() -> dict:
        model = service.registry.model(ns, req.model_id)
        rid = service.exports.save(model, req.path, req.ttl_seconds, req.age_encryption_recipients)
        return _future(rid, model.model_id)

    verb = "save_weights_external"
    return service.calls.journaled(ns, verb, req.model_id, req.seq_id, raw, answer)


def asample_verb(service: TinkerService, ns: str | None, raw: bytes) -> dict:
    from tinker import types as t

    req = _parse(t.SampleRequest, _json(raw))
    if req.sampling_session_id is None:
        raise ServiceError(
            400, "asample needs a sampling_session_id (create a sampling client first)"
        )
    prompt, images, scoring = check_sample_request(req, service.limits.max_samples)
    params = sample_params(req.sampling_params)
    n = req.num_samples

    def answer() -> dict:
        sampler = req.sampling_session_id
        rid = service.sampling.sample(ns, sampler, prompt, n, params, scoring, images)
        return _future(rid, None, sample_sequence_ids=[f"{rid}:{i}" for i in range(n)])

    return service.calls.journaled(ns, "asample", req.sampling_session_id, req.seq_id, raw, answer)


def create_model_verb(service: TinkerService, ns: str | None, raw: bytes) -> dict:
    """(Blocking: it writes the run's record; the route calls it in a thread.)"""
    from tinker import types as t

    req = _parse(t.CreateModelRequest, _json(raw))
    model_id = f"{req.session_id}:train:{req.model_seq_id}"

    def answer() -> dict:
        return _future(*service.registry.create_model(ns, req))

    return service.calls.journaled(ns, "create_model", model_id, req.model_seq_id, raw, answer)


VERBS = {
    "create_model": create_model_verb,
    "forward_backward": forward_backward_verb,
    "optim_step": optim_step_verb,
    "save_weights": save_weights_verb,
    "save_weights_for_sampler": save_for_sampler_verb,
    "save_weights_external": save_external_verb,
    "asample": asample_verb,
}


def _future(request_id: str, model_id: str | None = None, **extra: Any) -> dict:
    """What a verb answers: the future to retrieve its result by."""
    return {"request_id": request_id, "model_id": model_id, **extra}


def _null() -> Response:
    return Response(status_code=200, content=NULL, media_type="application/json")


def _client_routes(app: FastAPI, service: TinkerService) -> None:
    """Client configuration, health, capabilities, telemetry."""

    @app.post(f"{API}/client/config")
    async def client_config() -> dict:
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "parallel_fwdbwd_chunks": False,
            "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": True,
            "sample_join_sampling_session": False,
        }

    @app.post(f"{API}/client/dynamic_config")
    async def dynamic_config() -> dict:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get(f"{API}/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict:
        models = sorted(service.catalogue)
        return {
            "supported_models": [
                {"model_name": name, "trainable": True, "sampleable": True} for name in models
            ]
        }

    @app.post(f"{API}/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}


def _session_routes(app: FastAPI, service: TinkerService) -> None:
    """Sessions: create, heartbeat, finish, list, get."""
    from tinker import types as t

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict:
        data = await _body(request)
        _parse(t.CreateSessionRequest, data)
        session_id = service.registry.create_session(request.state.namespace, data)
        return {"type": "create_session", "session_id": session_id}

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        data = await _body(request)
        service.registry.heartbeat(request.state.namespace, data.get("session_id"))
        return {"type": "session_heartbeat"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish(request: Request, session_id: str) -> Response:
        session = service.registry.session(request.state.namespace, session_id, live=False)
        status = finish_status(await _body(request))
        end = service.registry.end_session
        await asyncio.to_thread(end, session, "finished by the client", status)
        return _null()

    @app.post(f"{API}/sessions/search")
    async def search(request: Request) -> dict:
        req = _parse(t.SessionSearchRequest, await _body(request))
        with service.lock:
            sessions = list(service.registry.sessions.values())
        ns = request.state.namespace
        return await asyncio.to_thread(search_sessions, sessions, service.checkpoints, ns, req)

    @app.get(f"{API}/sessions")
    async def sessions(request: Request, limit: int = 20, offset: int = 0) -> dict:
        ids = service.registry.session_ids(request.state.namespace)
        return {"sessions": ids[offset : offset + limit]}

    @app.get(f"{API}/sessions/{{session_id}}")
    async def get_session(request: Request, session_id: str) -> dict:
        s = service.registry.session(request.state.namespace, session_id, live=False)
        return {
            "training_run_ids": list(s.models),
            "sampler_ids": list(s.samplers),
            "user_metadata": s.user_metadata or None,
            "display_name": s.display_name,
            "tags": s.tags,
        }


def _model_routes(app: FastAPI, service: TinkerService) -> None:
    """Training models: create, describe, unload; what a saved state holds."""
    from tinker import types as t

    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict:
        raw = await request.body()
        return await asyncio.to_thread(create_model_verb, service, request.state.namespace, raw)

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict:
        req = _parse(t.GetInfoRequest, await _body(request))
        model = service.registry.model(request.state.namespace, req.model_id)
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "arch": "lora",
                "model_name": model.base_model,
                "tokenizer_id": model.base_model,  # the catalogue's name, its tokenizer's Hub id
            },
            "is_lora": True,
            "lora_rank": model.lora.r,
            "model_name": model.base_model,
        }

    @app.post(f"{API}/create_custom_loss")
    async def create_custom_loss(request: Request) -> dict:
        req = _parse(t.CreateCustomLossRequest, await _body(request))
        ns = request.state.namespace
        loss_id = await asyncio.to_thread(service.training.create_custom_loss, ns, req)
        rid = service.calls.answered_now(ns, {"loss_id": loss_id, "type": "create_custom_loss"})
        return _future(rid, None)

    @app.post(f"{API}/unload_model")
    async def unload_model(request: Request) -> dict:
        req = _parse(t.UnloadModelRequest, await _body(request))
        rid, model_id = await asyncio.to_thread(
            service.registry.unload_request, request.state.namespace, req.model_id
        )
        return _future(rid, model_id)

    @app.post(f"{API}/weights_info")
    async def weights_info(request: Request) -> dict:
        data = await _body(request)
        ns, path = request.state.namespace, data.get("tinker_path")
        _, _, folder = await asyncio.to_thread(service.checkpoints.parse_path, ns, path)
        record = await asyncio.to_thread(service.checkpoints.record, folder)
        lora = record["lora"]
        return {
            "base_model": record["base_model"],
            "is_lora": True,
            "lora_rank": lora["rank"],
            "train_unembed": lora["train_unembed"],
            "train_mlp": lora["train_mlp"],
            "train_attn": lora["train_attn"],
        }


def _training_routes(app: FastAPI, service: TinkerService) -> None:
    """forward_backward (protobuf), optim_step, save and load of states."""
    from tinker import types as t

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict:
        if "protobuf" not in request.headers.get("content-type", ""):
            raise ServiceError(415, "forward_backward takes application/x-protobuf")
        limit = 4 * service.limits.max_body_bytes
        raw = decompress(await request.body(), request.headers.get("content-encoding"), limit)
        return forward_backward_verb(service, request.state.namespace, raw)

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> dict:
        return optim_step_verb(service, request.state.namespace, await request.body())

    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> dict:
        return save_weights_verb(service, request.state.namespace, await request.body())

    @app.post(f"{API}/save_weights_external")
    async def save_weights_external(request: Request) -> dict:
        return save_external_verb(service, request.state.namespace, await request.body())

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        return save_for_sampler_verb(service, request.state.namespace, await request.body())

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> dict:
        req = _parse(t.LoadWeightsRequest, await _body(request))
        rid, model_id = await asyncio.to_thread(
            service.training.load_weights, request.state.namespace, req
        )
        return _future(rid, model_id)


def _sampling_routes(app: FastAPI, service: TinkerService) -> None:
    """Sampling sessions and asample."""
    from tinker import types as t

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        req = _parse(t.CreateSamplingSessionRequest, await _body(request))
        sid = await asyncio.to_thread(service.sampling.create, request.state.namespace, req)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.post(f"{API}/join_sampling_session")
    async def join_sampling_session(request: Request) -> dict:
        req = _parse(t.JoinSamplingSessionRequest, await _body(request))
        clients = service.sampling.join(request.state.namespace, req.sampling_session_id)
        return {"type": "join_sampling_session", "client_counter": clients}

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(request: Request, sampler_id: str) -> dict:
        s = service.sampling.sampler(request.state.namespace, sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict:
        return asample_verb(service, request.state.namespace, await request.body())


def _future_routes(app: FastAPI, service: TinkerService) -> None:
    """retrieve_future (long-polled) and cancel_future."""

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        data = await _body(request)
        entry = service.calls.future(request.state.namespace, data.get("request_id"))
        if entry.future.cancelled():
            return JSONResponse({"error": "the request was cancelled", "category": "user"})
        try:
            result = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(entry.future)), service.limits.long_poll_s
            )
        except TimeoutError:
            service.calls.try_again += 1
            again = {"type": "try_again", "request_id": data["request_id"]}
            return JSONResponse(again | {"queue_state": "active"}, status_code=408)
        except (ServiceError, TinkerInputError) as e:
            service.calls.done(data["request_id"])
            return JSONResponse({"error": str(e), "category": "user"})
        except Exception as e:  # the model's own failure: the future fails, the server serves on
            service.calls.done(data["request_id"])
            return JSONResponse({"error": f"{type(e).__name__}: {e}"[:2000], "category": "server"})
        service.calls.done(data["request_id"])
        if isinstance(result, bytes):
            return Response(result, media_type="application/x-protobuf")
        return JSONResponse(result)

    @app.post(f"{API}/cancel_future")
    async def cancel_future(request: Request) -> Response:
        data = await _body(request)
        service.calls.future(request.state.namespace, data.get("request_id")).future.cancel()
        return _null()


def _copy_routes(app: FastAPI, service: TinkerService) -> None:
    """``copy_weights``: a checkpoint copied into a new run that holds only it."""
    from tinker import types as t

    copies: dict[tuple[str | None, str], str] = {}  # (namespace, idempotency key) -> path

    @app.post(f"{API}/copy_weights")
    async def copy_weights(request: Request) -> dict:
        req = _parse(t.CopyWeightsRequest, await _body(request))
        if req.weights_access_token or request.headers.get("x-tinker-weights-access-token"):
            raise ServiceError(400, "weights_access_token is not supported here (no accounts)")
        ns, key = request.state.namespace, request.headers.get("x-idempotency-key", "")[:200]
        if key and (ns, key) in copies:  # the SDK's retry of a copy made
            return {"tinker_path": copies[ns, key]}
        run_id, project = _copy_target(service, ns, req)
        copy = service.checkpoints.copy
        path = await asyncio.to_thread(copy, ns, req.source_path, run_id, project, req.ttl_seconds)
        if key:
            copies[ns, key] = path
            if len(copies) > MAX_COPY_KEYS:  # the oldest first: retries come within minutes
                copies.pop(next(iter(copies)))
        return {"tinker_path": path}


def _copy_target(service: TinkerService, ns: str | None, req: Any) -> tuple[str, str | None]:
    """The new run's id and project: the session's next slot and project, or a run of its own
    in the project named."""
    if req.session_id is not None and req.model_seq_id is not None:
        project = service.registry.session(ns, req.session_id).project_id
        return f"{req.session_id}:train:{req.model_seq_id}", project
    if req.destination_project_id is not None and req.session_id is None:
        return f"{secrets.token_hex(8)}:train:0", req.destination_project_id
    raise ServiceError(400, "give destination_project_id, or both session_id and model_seq_id")


def _run_routes(app: FastAPI, service: TinkerService) -> None:
    """Training runs and their checkpoints: list, get, delete."""

    @app.get(f"{API}/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
        ns = request.state.namespace
        runs = await asyncio.to_thread(service.checkpoints.runs, ns)
        views = []
        for run in runs[offset : offset + max(0, limit)]:
            cps = await asyncio.to_thread(service.checkpoints.of_run, ns, run["training_run_id"])
            views.append(run_view(run, cps))
        cursor = {"offset": offset, "limit": limit, "total_count": len(runs)}
        return {"training_runs": views, "cursor": cursor}

    @app.get(f"{API}/training_runs/{{run_id}}")
    async def training_run(request: Request, run_id: str) -> dict:
        ns = request.state.namespace
        cps = await asyncio.to_thread(service.checkpoints.of_run, ns, run_id)
        run = await asyncio.to_thread(service.checkpoints.run_record, ns, run_id)
        return run_view(run, cps)

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def run_checkpoints(request: Request, run_id: str) -> dict:
        cps = await asyncio.to_thread(service.checkpoints.of_run, request.state.namespace, run_id)
        return {"checkpoints": [checkpoint_view(c) for c in cps]}

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}")
    async def delete_checkpoint(request: Request, run_id: str, kind: str, name: str) -> Response:
        path = f"tinker://{run_id}/{kind}/{name}"
        await asyncio.to_thread(service.checkpoints.delete, request.state.namespace, path)
        return _null()

    @app.put(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/ttl")
    async def checkpoint_ttl(request: Request, run_id: str, kind: str, name: str) -> Response:
        body = await _body(request)
        path, ns = f"tinker://{run_id}/{kind}/{name}", request.state.namespace
        await asyncio.to_thread(service.checkpoints.set_ttl, ns, path, body.get("ttl_seconds"))
        return _null()

    @app.post(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/publish")
    async def publish(request: Request, run_id: str, kind: str, name: str) -> Response:
        path, ns = f"tinker://{run_id}/{kind}/{name}", request.state.namespace
        await asyncio.to_thread(service.checkpoints.publish, ns, path, True)
        return _null()

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/publish")
    async def unpublish(request: Request, run_id: str, kind: str, name: str) -> Response:
        path, ns = f"tinker://{run_id}/{kind}/{name}", request.state.namespace
        await asyncio.to_thread(service.checkpoints.publish, ns, path, False)
        return _null()

    @app.get(f"{API}/checkpoints")
    async def all_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict:
        every = await asyncio.to_thread(service.checkpoints.everything, request.state.namespace)
        page = every[offset : offset + max(0, limit)]
        cursor = {"offset": offset, "limit": limit, "total_count": len(every)}
        return {"checkpoints": [checkpoint_view(c) for c in page], "cursor": cursor}
