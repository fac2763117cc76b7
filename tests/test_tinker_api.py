"""The Tinker API through the official ``tinker`` SDK (0.38.0), never a hand-written client
(raw HTTP only where a test sends what the SDK never would: malformed bodies, another key's
ids). The service runs for real: uvicorn on a loopback port, models in the service's process
(``InProcess`` placement; the Prefect/Ray sessions are in ``test_stack.py``)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from services import TinkerServer
from tinker import types

from flowrl.backends.models.tinker_checkpoints import resolve_base_model as base_folder
from flowrl.backends.policy.placement import InProcess
from flowrl.backends.services.tinker.service import Limits, TinkerService
from flowrl.infra.servers import free_port

ALICE = "tml-alice-" + "a" * 24
BOB = "tml-bob-" + "b" * 26
BASE = "flowrl/tiny"


class Server(TinkerServer):
    """The service for these tests, with the SDK clients and raw posts they make."""

    def __init__(self, service: TinkerService):
        super().__init__(service)
        self.clients: list[tinker.ServiceClient] = []

    def client(self, key: str = ALICE) -> tinker.ServiceClient:
        client = tinker.ServiceClient(base_url=self.url, api_key=key)
        self.clients.append(client)
        return client

    def close_clients(self) -> None:
        """Finish every session the test opened: its models are unloaded."""
        while self.clients:
            self.clients.pop().close("success").result()

    def post(
        self, path: str, key: str = ALICE, headers: dict | None = None, **kw
    ) -> httpx.Response:
        headers = {"X-API-Key": key, **(headers or {})}
        return httpx.post(f"{self.url}/api/v1/{path}", headers=headers, timeout=30, **kw)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("tinker-home")
    saved = os.environ.get("FLOWRL_HOME")
    os.environ["FLOWRL_HOME"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("FLOWRL_HOME", None)
    else:
        os.environ["FLOWRL_HOME"] = saved


@pytest.fixture(scope="module")
def server(home: Path) -> Iterator[Server]:
    limits = Limits(max_body_bytes=2**20, max_models_per_namespace=6)
    service = TinkerService(InProcess(), keys={ALICE: "alice", BOB: "bob"}, limits=limits)
    srv = Server(service)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _finish_sessions(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test's sessions end with it (6 live models per key at most)."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").close_clients()


@pytest.fixture(scope="module")
def tokenizer(home: Path):
    from flowrl.backends.models.model_folder import load_tokenizer

    return load_tokenizer(base_folder("tiny", str(home / "model-cache")))


def _datums(tokenizer, lines: list[str]) -> list[types.Datum]:
    out = []
    for line in lines:
        ids = tokenizer.encode(line)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return out


LINES = ["12+7=19", "3+4=7", "5+5=10", "21+13=34", "8+9=17", "40+2=42"]


def test_save_state_then_resume_with_optimizer_is_exact(server: Server, tokenizer) -> None:
    """``save_state`` then ``create_training_client_from_state_with_optimizer``: the same
    forward NLL, and the next step (AdamW moments restored) matches the uninterrupted run."""
    client = server.client()
    first = client.create_lora_training_client(BASE, rank=8, seed=1).result()
    data = _datums(tokenizer, LINES)
    adam = types.AdamParams(learning_rate=5e-3)
    for _ in range(3):
        first.forward_backward(data, "cross_entropy")
        first.optim_step(adam).result()
    path = first.save_state("after-3").result().path
    assert path == f"tinker://{first.get_info().model_id}/weights/after-3"
    second = client.create_training_client_from_state_with_optimizer(path).result()
    a = first.forward(data, "cross_entropy").result()
    b = second.forward(data, "cross_entropy").result()
    assert abs(a.metrics["loss:sum"] - b.metrics["loss:sum"]) <= 1e-5
    at_save = a.metrics["loss:sum"]
    for one, two in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(
            one["logprobs"].to_numpy(), two["logprobs"].to_numpy(), atol=1e-6
        )
    for tc in (first, second):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam).result()
    a = first.forward(data, "cross_entropy").result().metrics["loss:sum"]
    b = second.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert abs(a - b) <= 1e-5, (a, b)
    # Weights only (a fresh optimizer): the weights as saved.
    third = client.create_training_client_from_state(path).result()
    assert abs(third.forward(data, "cross_entropy").result().metrics["loss:sum"] - at_save) <= 1e-5
    # load_state / load_state_with_optimizer into a running client of the same shape.
    fourth = client.create_lora_training_client(BASE, rank=8, seed=9).result()
    fourth.load_state_with_optimizer(path).result()
    assert abs(fourth.forward(data, "cross_entropy").result().metrics["loss:sum"] - at_save) <= 1e-5
    fourth.forward_backward(data, "cross_entropy")
    fourth.optim_step(adam).result()
    assert abs(fourth.forward(data, "cross_entropy").result().metrics["loss:sum"] - a) <= 1e-5
    # Five training models of one base model, all on one copy of its weights (InProcess).
    (shared,) = server.service.placement.bases.values()
    assert len(shared.resident) >= 4
    other_shape = client.create_lora_training_client(BASE, rank=4, seed=9).result()
    with pytest.raises(tinker.BadRequestError, match="another base model or LoRA shape"):
        other_shape.load_state(path).result()


def test_sampling_follows_its_parameters(server: Server, tokenizer) -> None:
    """``num_samples``, seeds, stop tokens and strings, per-token and prompt log-probs that
    agree with the trainer's."""
    client = server.client()
    tc = client.create_lora_training_client(BASE, rank=4, seed=2).result()
    data = _datums(tokenizer, LINES)
    for _ in range(5):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+7="))

    def sample(n: int, **params) -> types.SampleResponse:
        return sampler.sample(prompt, n, types.SamplingParams(**params)).result()

    one = sample(4, max_tokens=6, temperature=1.0, seed=7)
    again = sample(4, max_tokens=6, temperature=1.0, seed=7)
    assert len(one.sequences) == 4
    assert [s.tokens for s in one.sequences] == [s.tokens for s in again.sequences]
    assert all(len(s.tokens) == len(s.logprobs) <= 6 for s in one.sequences)
    assert all(lp <= 0 for s in one.sequences for lp in s.logprobs)
    greedy = sample(1, max_tokens=6, temperature=0.0).sequences[0]
    stop_at = greedy.tokens[1]
    stopped = sample(1, max_tokens=6, temperature=0.0, stop=[stop_at]).sequences[0]
    first_stop = greedy.tokens.index(stop_at) + 1
    assert stopped.tokens == greedy.tokens[:first_stop] and stopped.stop_reason == "stop"
    assert sample(1, max_tokens=3, temperature=0.0).sequences[0].stop_reason == "length"
    text = tokenizer.decode(greedy.tokens[:2])
    by_string = sample(1, max_tokens=6, temperature=0.0, stop=[text]).sequences[0]
    assert by_string.stop_reason == "stop" and len(by_string.tokens) <= 2
    # The sampler's prompt log-probs are the trainer's log-probs of the same tokens.
    ids = tokenizer.encode("12+7=19")
    scored = sampler.sample(
        types.ModelInput.from_ints(ids),
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
    ).result()
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(ids)
    trained = tc.forward(_datums(tokenizer, ["12+7=19"]), "cross_entropy").result()
    np.testing.assert_allclose(
        scored.prompt_logprobs[1:], trained.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-4
    )


def test_saved_sampler_weights_serve_new_clients(server: Server, tokenizer) -> None:
    """``save_weights_for_sampler(name)`` → a ``tinker://`` path that a new sampling client
    samples greedily exactly as the trainer's snapshot does; runs and checkpoints are listed."""
    client = server.client()
    tc = client.create_lora_training_client(BASE, rank=4, seed=3).result()
    for _ in range(5):
        tc.forward_backward(_datums(tokenizer, LINES), "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_weights_for_sampler("five").result().path
    tc.forward_backward(_datums(tokenizer, LINES), "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # moves on; the path stays
    prompt = types.ModelInput.from_ints(tokenizer.encode("3+4="))
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
    from_path = (
        client.create_sampling_client(model_path=path).result().sample(prompt, 1, greedy).result()
    )
    base = (
        client.create_sampling_client(base_model=BASE).result().sample(prompt, 1, greedy).result()
    )
    again = (
        client.create_sampling_client(model_path=path).result().sample(prompt, 1, greedy).result()
    )
    assert from_path.sequences[0].tokens == again.sequences[0].tokens
    assert from_path.sequences[0].logprobs != base.sequences[0].logprobs
    rest = tinker.RestClient(base_url=server.url, api_key=ALICE)
    run_id = tc.get_info().model_id
    assert run_id in [
        r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs
    ]
    listed = [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints]
    assert path in listed
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.base_model == BASE and info.lora_rank == 4


def test_a_sampler_checkpoint_registers_as_an_mlflow_model(
    server: Server, tokenizer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``flowrl tinker register``: the checkpoint becomes a version of the namespace's model,
    with lineage, whose pyfunc loads and answers; its merged weights give the adapter's
    log-probs."""
    import glob

    import mlflow
    import pandas as pd
    import torch

    from flowrl.backends.models.model_folder import load_causal_lm
    from flowrl.cli import main
    from flowrl.infra.tracking import download_model

    tc = server.client().create_lora_training_client(BASE, rank=4, seed=8).result()
    data = _datums(tokenizer, LINES[:3])
    for _ in range(5):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    trained = tc.forward(data, "cross_entropy").result()
    path = tc.save_weights_for_sampler("to-register").result().path
    monkeypatch.setenv("FLOWRL_NAMESPACE", "alice")
    assert main(["tinker", "register", path, "--name", "tinker-policy"]) == 0
    uri = capsys.readouterr().out.strip().splitlines()[-1]
    assert uri == "models:/alice_tinker-policy/1"
    version = mlflow.MlflowClient().get_model_version("alice_tinker-policy", "1")
    assert version.tags["flowrl.kind"] == "tinker"
    assert version.tags["flowrl.job"] == tc.get_info().model_id
    answer = mlflow.pyfunc.load_model(uri).predict(
        pd.DataFrame({"messages": [[{"role": "user", "content": "2+3?"}]]}),
        params={"max_new_tokens": 4},
    )
    assert isinstance(answer["content"][0], str)
    configs = glob.glob(f"{download_model(uri)}/**/config.json", recursive=True)
    merged = load_causal_lm(str(Path(configs[0]).parent))
    for datum, out in zip(data, trained.loss_fn_outputs, strict=True):
        ids = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
        logp = torch.log_softmax(merged(ids).logits[0], -1)[range(len(targets)), targets]
        np.testing.assert_allclose(logp.detach().numpy(), out["logprobs"].to_numpy(), atol=1e-5)
    # Bob's namespace has no such checkpoint.
    monkeypatch.setenv("FLOWRL_NAMESPACE", "bob")
    assert main(["tinker", "register", path, "--name", "stolen"]) == 2


def test_a_key_holds_at_most_its_limit_of_live_models(server: Server) -> None:
    """The 7th live model of a key is refused at once (403, not a 429 the SDK would retry for
    minutes); finishing the session frees them."""
    client = server.client()
    held = [client.create_lora_training_client(BASE, rank=2, seed=i).result() for i in range(6)]
    started = time.monotonic()
    with pytest.raises(tinker.PermissionDeniedError, match="at most 6 live models per key"):
        client.create_lora_training_client(BASE, rank=2, seed=6).result()
    assert time.monotonic() - started < 10
    server.close_clients()
    assert held and server.client().create_lora_training_client(BASE, rank=2).result()


def test_keys_see_only_their_own_runs(server: Server, tokenizer) -> None:
    """Bob cannot list, sample, load or touch Alice's runs and checkpoints; an unknown key
    gets 401."""
    alice = server.client(ALICE)
    tc = alice.create_lora_training_client(BASE, rank=4, seed=4).result()
    model_id = tc.get_info().model_id
    state = tc.save_state("mine").result().path
    sampler_path = tc.save_weights_for_sampler("mine-s").result().path
    bob = server.client(BOB)
    runs = (
        tinker.RestClient(base_url=server.url, api_key=BOB)
        .list_training_runs(limit=100)
        .result()
        .training_runs
    )
    assert model_id not in [r.training_run_id for r in runs]
    with pytest.raises(Exception, match="404|no training run"):
        tinker.RestClient(base_url=server.url, api_key=BOB).list_checkpoints(model_id).result()
    with pytest.raises(Exception, match="404|no checkpoint"):
        bob.create_sampling_client(model_path=sampler_path).result()
    with pytest.raises(Exception, match="404|no checkpoint"):
        bob.create_training_client_from_state(state).result()
    assert server.post("get_info", BOB, json={"model_id": model_id}).status_code == 404
    assert (
        server.post("save_weights", BOB, json={"model_id": model_id, "path": "x"}).status_code
        == 404
    )
    unknown = server.post("create_session", "tml-nobody-" + "z" * 20, json={})
    assert unknown.status_code == 401, unknown.text
    assert server.post("create_session", "", json={}).status_code == 401
    # Alice still reaches hers.
    assert alice.create_sampling_client(model_path=sampler_path).result() is not None


def test_bad_input_is_a_4xx_and_the_server_goes_on(server: Server, tokenizer) -> None:
    client = server.client()
    tc = client.create_lora_training_client(BASE, rank=4, seed=5).result()
    good = _datums(tokenizer, LINES[:2])
    ids = tokenizer.encode("12+7=19")

    def datum(**inputs) -> types.Datum:
        return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)

    cases = {
        "target_tokens": datum(target_tokens=ids[1:-1], weights=[1.0] * (len(ids) - 1)),
        "weights": datum(target_tokens=ids[1:], weights=[1.0] * (len(ids) - 3)),
        "vocabulary": datum(target_tokens=[10_000] * (len(ids) - 1)),
    }
    for word, bad in cases.items():
        with pytest.raises(tinker.BadRequestError, match=word):
            tc.forward_backward([bad], "cross_entropy").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    for prompt, params, word in (
        ([5, 6, 10_000], types.SamplingParams(max_tokens=4), "vocabulary"),
        ([5, 6], types.SamplingParams(max_tokens=100_000), "context length"),
        ([5, 6], types.SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
        ([5, 6], types.SamplingParams(max_tokens=4, stop=[10_000]), "stop"),
    ):
        with pytest.raises(Exception, match=word):  # a 400 at submission; the SDK re-raises it
            sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="dro"):
        tc.forward_backward(good, "dro").result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn_config"):
        tc.forward_backward(good, "cross_entropy", {"clip_low_threshold": 0.5}).result()
    raw = {
        "forward_backward": dict(
            content=b"\xff\x00garbage", headers={"Content-Type": "application/x-protobuf"}
        ),
        "optim_step": dict(content=b"{not json", headers={"Content-Type": "application/json"}),
        "create_model": dict(json={"session_id": "x", "model_seq_id": 0}),
        "retrieve_future": dict(json={"request_id": "no-such-future"}),
        "get_info": dict(json={"model_id": "0123456789abcdef:train:9"}),
        "asample": dict(
            json={"prompt": {"chunks": []}, "sampling_params": {}, "sampling_session_id": "nope"}
        ),
    }
    for path, kwargs in raw.items():
        r = server.post(path, **kwargs)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        assert r.json()["detail"], path
    big = server.post(
        "optim_step", content=b"x" * (2**20 + 1), headers={"Content-Type": "application/json"}
    )
    assert big.status_code == 413
    # The session and the server go on.
    out = tc.forward_backward(good, "cross_entropy").result()
    assert math.isfinite(out.metrics["loss:sum"]) and len(out.loss_fn_outputs) == 2
    assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}
    # Unloading a model (the REST verb; this SDK has no method for it): then it answers 410.
    model_id = tc.get_info().model_id
    unload = server.post("unload_model", json={"model_id": model_id})
    assert unload.status_code == 200
    done = server.post("retrieve_future", json={"request_id": unload.json()["request_id"]})
    assert done.json() == {"model_id": model_id, "type": "unload_model"}
    assert server.post("get_info", json={"model_id": model_id}).status_code == 410


def test_a_session_without_heartbeats_ends_and_keeps_its_states(home: Path, tokenizer) -> None:
    """A client that stops heartbeating: after the TTL its models are unloaded (410), and its
    saved state loads in a new session."""
    limits = Limits(session_ttl_s=2.0, long_poll_s=0.001)  # results come after 408s
    service = TinkerService(InProcess(), keys={ALICE: "alice"}, limits=limits)
    srv = Server(service)
    try:
        live = srv.client()  # its SDK heartbeats every 10 s: outlives the 2 s TTL only between
        tc = live.create_lora_training_client(BASE, rank=4, seed=6).result()
        path = tc.save_state("kept").result().path
        tc.forward(_datums(tokenizer, LINES * 50), "cross_entropy").result()  # ~0.1 s of work
        model_id = tc.get_info().model_id
        session_id = model_id.split(":")[0]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not service.sessions[session_id].ended:
            time.sleep(0.2)
        assert service.sessions[session_id].ended.startswith("no heartbeat")
        assert srv.post("get_info", json={"model_id": model_id}).status_code == 410
        assert service.try_again > 0  # the SDK took 408 try_again answers and asked again
        fresh = srv.client().create_training_client_from_state(path).result()
        assert fresh.forward(_datums(tokenizer, LINES[:1]), "cross_entropy").result().metrics
    finally:
        srv.stop()


class ServiceProcess:
    """``flowrl serve tinker`` (local placement) as a process of its own, started again on the
    same port (and ``--journal``, when given) after a kill."""

    def __init__(self, log: Path, journal: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "FLOWRL_TINKER_KEYS": f"alice:{ALICE}"}
        self.cmd = [sys.executable, "-m", "flowrl", "serve", "tinker", "--port", str(self.port)]
        self.cmd += ["--journal", str(journal)] if journal else []
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServiceProcess:
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab")
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/api/v1/healthz", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        self.proc.kill()
        raise AssertionError(self.log.read_text())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)
            self.proc.wait(20)
            self.proc = None

    def client(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=ALICE)


def test_saved_states_load_after_a_killed_service(home: Path, tokenizer, tmp_path: Path) -> None:
    """``flowrl serve tinker`` killed with SIGKILL and started again: a client's
    ``create_training_client_from_state`` of a path saved before works, with the same NLL."""
    data = _datums(tokenizer, LINES)
    service = ServiceProcess(tmp_path / "log").start()
    try:
        client = service.client()
        tc = client.create_lora_training_client(BASE, rank=4, seed=7).result()
        for _ in range(3):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        path = tc.save_state("before-kill").result().path
        before = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    finally:
        service.stop(signal.SIGKILL)
    service.start()
    try:
        again = service.client().create_training_client_from_state_with_optimizer(path).result()
        after = again.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert abs(before - after) <= 1e-5
    finally:
        service.stop()


def _steps(tc, data, steps: int) -> list[float]:
    """``steps`` optimizer steps; the loss (a forward pass) after each."""
    out = []
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        out.append(tc.forward(data, "cross_entropy").result().metrics["loss:sum"])
    return out


def test_models_lost_with_a_killed_service_are_made_again_exactly(
    home: Path, tokenizer, tmp_path: Path
) -> None:
    """``flowrl serve tinker --journal`` SIGKILLed with two training models in its process:
    started again, it makes each again from its journaled history (its last saved state,
    then every call since, gradients not yet stepped included), and the clients' loops carry
    on, with the losses of a run that was never killed. A model made with no seed (the
    service draws one and journals it) is made again with the same weights."""
    data = _datums(tokenizer, LINES)
    reference = ServiceProcess(tmp_path / "reference.log").start()
    try:
        tc = reference.client().create_lora_training_client(BASE, rank=4, seed=7).result()
        expected = _steps(tc, data, 2)
        tc.forward_backward(data, "cross_entropy")
        expected += _steps(tc, data, 2)  # the first step takes the gradients of two batches
    finally:
        reference.stop()

    service = ServiceProcess(tmp_path / "log", journal=tmp_path / "journal").start()
    try:
        client = service.client()
        tc = client.create_lora_training_client(BASE, rank=4, seed=7).result()
        unseeded = client.create_lora_training_client(BASE, rank=4).result()
        losses = _steps(tc, data, 1)
        tc.save_state("mid").result()
        losses += _steps(tc, data, 1)
        tc.forward_backward(data, "cross_entropy").result()  # gradients not yet stepped
        _steps(unseeded, data, 2)
        unseeded_before = unseeded.forward(data, "cross_entropy").result().metrics["loss:sum"]
        service.stop(signal.SIGKILL)
        service.start()
        losses += _steps(tc, data, 2)  # the same clients, through the restart
        unseeded_after = unseeded.forward(data, "cross_entropy").result().metrics["loss:sum"]
    finally:
        service.stop()
    assert np.allclose(losses, expected, rtol=1e-4), (losses, expected)
    assert abs(unseeded_after - unseeded_before) <= 1e-4 * abs(unseeded_before)
    log = (tmp_path / "log").read_text()
    assert "2 to make again from their history" in log, log[-2000:]
    assert log.count("made again from its history") == 2, log[-2000:]


def test_the_service_starts_only_with_keys_or_on_loopback(tmp_path: Path, capsys) -> None:
    """Without keys ``flowrl serve tinker`` refuses to start, and ``--insecure-loopback`` serves
    loopback addresses only; keys come from a file (or FLOWRL_TINKER_KEYS) as namespace:key."""
    from flowrl.backends.services.tinker.server import read_keys
    from flowrl.cli import main

    assert main(["serve", "tinker"]) == 2
    assert "no keys" in capsys.readouterr().err
    assert main(["serve", "tinker", "--insecure-loopback", "--host", "0.0.0.0"]) == 2
    assert "loopback addresses only" in capsys.readouterr().err
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    assert read_keys(str(keys)) == {ALICE: "alice", BOB: "bob"}
    keys.write_text("alice:not-a-tinker-key-0000000000\n")
    with pytest.raises(SystemExit, match="tml-"):
        read_keys(str(keys))


def test_a_base_model_that_does_not_load_fails_its_request_not_the_server(home: Path) -> None:
    """A catalogue entry whose folder is gone: ``create_lora_training_client`` fails with the
    loader's message, the model leaves no slot taken, and the server serves on."""
    catalogue = {"gone": str(home / "no-such-model"), BASE: "tiny"}
    service = TinkerService(
        InProcess(),
        catalogue=catalogue,
        keys={ALICE: "alice"},
        limits=Limits(max_models_per_namespace=1),
    )
    srv = Server(service)
    try:
        client = srv.client()
        with pytest.raises(tinker.RequestFailedError, match="no model folder"):
            client.create_lora_training_client("gone", rank=4).result()
        assert client.create_lora_training_client(BASE, rank=4, seed=0).result().get_info()
    finally:
        srv.close_clients()
        srv.stop()


class _DeadActor:
    """The handle of a model whose actor has died: each call raises what Ray raises then;
    closing it frees what the model held (here: ``handle``'s adapter on the base)."""

    def __init__(self, handle) -> None:  # noqa: ANN001 - a LocalHandle
        self.handle = handle
        self.info = handle.info

    def call(self, method: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        from ray.exceptions import ActorDiedError

        raise ActorDiedError()

    def close(self) -> None:
        self.handle.close()


def test_a_long_history_is_cut_by_a_saved_state_and_a_lost_model_is_made_again(
    home: Path, tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a journal, a model whose history passes the bound is saved by the service (one
    state kept, not the client's checkpoint) and its history starts again there; a model
    whose actor dies under a call is made again from that state before the call runs, and the
    loop carries on with the losses it would have had."""
    from flowrl.backends.services.tinker import training
    from flowrl.backends.services.tinker.journal import Journal, pending

    monkeypatch.setattr(training, "HISTORY_BYTES", 0)  # every step cuts the history
    data = _datums(tokenizer, LINES)
    service = TinkerService(InProcess(), keys={ALICE: "alice"}, journal=Journal(tmp_path))
    srv = Server(service)
    try:
        tc = srv.client().create_lora_training_client(BASE, rank=4, seed=3).result()
        reference = Server(TinkerService(InProcess(), keys={ALICE: "alice"}))
        try:
            ref = reference.client().create_lora_training_client(BASE, rank=4, seed=3).result()
            expected = _steps(ref, data, 4)
        finally:
            reference.stop()
        losses = _steps(tc, data, 3)
        model = service.registry.models[tc.get_info().model_id]
        history = pending(service.journal.read()).history[model.model_id]
        assert [h["op"] for h in history] == ["loaded"], history  # cut at the last step
        assert "/restore/" in history[0]["folder"]
        assert len(service.storage.list(history[0]["folder"].rsplit("/", 1)[0])) == 1  # one kept
        with service.lock:
            model.handle = _DeadActor(model.handle)
        losses += _steps(tc, data, 1)
        assert np.allclose(losses, expected, rtol=1e-4), (losses, expected)
        kept = model.restore_folder
        assert kept is not None and service.storage.exists(kept)
        service.registry.unload(model, "unloaded by the test")
        model.worker.shutdown(wait=True)
        assert not service.storage.exists(kept)  # an unloaded model's state goes with it
    finally:
        srv.stop()


def test_the_sdks_policy_losses_reach_the_model(server: Server, tokenizer) -> None:
    """``dro`` (with its ``beta``) and ``gspo`` through the SDK train a model: RL data whose
    advantage favours one completion raises its log-prob; ``stable_reinforce`` is a 400 that
    says why (the math of each loss: ``test_tinker_losses.py``)."""
    ids = tokenizer.encode("12+7=19")
    n = len(ids) - 1

    def rl_datum(sampler_logprobs: list[float]) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={
                "target_tokens": ids[1:],
                "logprobs": sampler_logprobs,
                "advantages": [0.0] * 2 + [1.0] * (n - 2),
            },
        )

    for loss_fn, config in (("dro", {"beta": 0.1}), ("gspo", {"clip_high_threshold": 1.5})):
        tc = server.client().create_lora_training_client(BASE, rank=4, seed=5).result()
        probe = tc.forward([_datums(tokenizer, ["12+7=19"])[0]], "cross_entropy").result()
        before = probe.loss_fn_outputs[0]["logprobs"].data
        for _ in range(3):
            tc.forward_backward([rl_datum(list(before))], loss_fn, config).result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = tc.forward([_datums(tokenizer, ["12+7=19"])[0]], "cross_entropy").result()
        gained = sum(after.loss_fn_outputs[0]["logprobs"].data[2:]) - sum(before[2:])
        assert gained > 0, (loss_fn, gained)
    with pytest.raises(tinker.BadRequestError, match="record_stability_info"):
        tc.forward_backward([rl_datum(list(before))], "stable_reinforce").result()


def test_forward_backward_custom_runs_a_clients_loss(server: Server, tokenizer) -> None:
    """``forward_backward_custom`` with a plain function: the SDK takes the log-probs (a
    forward pass), runs the loss on the client and sends its gradient back as a weighted
    ``cross_entropy``. A loss that is cross-entropy written by hand gives cross-entropy's
    value and trains as it does."""
    import torch

    data = _datums(tokenizer, LINES[:2])

    def nll(batch: list, logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"custom/nll:sum": float(loss)}

    tc = server.client().create_lora_training_client(BASE, rank=4, seed=9).result()
    twin = server.client().create_lora_training_client(BASE, rank=4, seed=9).result()
    first = tc.forward_backward_custom(data, nll).result()
    expected = twin.forward_backward(data, "cross_entropy").result()
    assert abs(first.metrics["custom/nll:sum"] - expected.metrics["loss:sum"]) < 1e-4
    for client in (tc, twin):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (tc, twin)]
    assert after[0] < expected.metrics["loss:sum"]
    assert abs(after[0] - after[1]) < 1e-4 * abs(after[1])  # the same step as cross-entropy's

    def weighted_nll(logprobs: torch.Tensor, weights: torch.Tensor):  # noqa: ANN202
        loss = -(logprobs * weights).sum()
        return loss, {"custom/nll:sum": loss}

    # A loss made with create_custom_loss is uploaded (the client config says
    # custom_loss_server_side) and runs on the server in one forward_backward: the same value,
    # the same step.
    service = server.client()
    handle = service.create_custom_loss(weighted_nll, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is not None
    fresh = service.create_lora_training_client(BASE, rank=4, seed=9).result()
    out = fresh.forward_backward_custom(data, handle).result()
    assert abs(out.metrics["custom/nll:sum"] - expected.metrics["loss:sum"]) < 1e-4
    assert abs(out.metrics["loss:sum"] - expected.metrics["loss:sum"]) < 1e-4
    fresh.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    stepped = fresh.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert abs(stepped - after[1]) < 1e-4 * abs(after[1])


def test_a_hostile_custom_loss_is_a_400_and_the_server_goes_on(server: Server) -> None:
    """A loss graph sent to ``create_custom_loss`` that calls outside the allow-list (here
    ``os.system``) is refused with a 400 naming it; nothing runs, and the session goes on."""
    client = server.client()
    tc = client.create_lora_training_client(BASE, rank=2, seed=1).result()
    session_id = client.holder.get_session_id()
    nodes = [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
        {"op": "call_function", "name": "y", "target": "os.system", "args": ["touch /tmp/pwned"]},
        {
            "op": "output",
            "name": "output",
            "target": "output",
            "args": [{"tuple": [{"ref": "y"}, {"dict": {}}]}],
        },
    ]
    body = {
        "session_id": session_id,
        "custom_loss_seq_id": 0,
        "name": "evil",
        "inputs": [{"name": "logprobs", "rank": 1}],
        "graph": {"format": 1, "nodes": nodes},
        "type": "create_custom_loss",
    }
    refused = server.post("create_custom_loss", json=body)
    assert refused.status_code == 400 and "'os.system' is not allowed" in refused.text
    assert tc.get_info().model_id  # the server and the session go on


def test_the_models_per_key_limit_is_configurable(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``flowrl serve tinker``'s live-models-per-key limit: ``--max-models-per-key``, else
    ``FLOWRL_TINKER_MAX_MODELS``, else 8; a value that is not a whole number >= 1 stops the
    command with a line naming it (the limit's 403 itself: the test above)."""
    from flowrl.backends.services.tinker.server import parse_args

    assert parse_args([]).max_models_per_key == Limits.max_models_per_namespace
    monkeypatch.setenv("FLOWRL_TINKER_MAX_MODELS", "3")
    assert parse_args([]).max_models_per_key == 3
    assert parse_args(["--max-models-per-key", "5"]).max_models_per_key == 5
    monkeypatch.setenv("FLOWRL_TINKER_MAX_MODELS", "many")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "FLOWRL_TINKER_MAX_MODELS: 'many' is not a whole number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--max-models-per-key", "0"])
    assert "0 is not at least 1" in capsys.readouterr().err


def test_prompt_scoring_matches_a_full_softmax(server: Server, home: Path, tokenizer) -> None:
    """``topk_prompt_logprobs``, ``target_prompt_logprobs`` and ``prompt_logprobs_last_n`` on a
    base-model sampler equal a full softmax over the vocabulary of the same model, loaded here
    with ``transformers``; out-of-range asks are 400s."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode("12+7=19 and 3+4=7")
    sampler = server.client().create_sampling_client(base_model=BASE)
    targets = np.array([[ids[i + 1], 3, -1] for i in range(len(ids) - 1)], dtype=np.int64)
    out = sampler.sample(
        types.ModelInput.from_ints(ids),
        1,
        types.SamplingParams(max_tokens=1, temperature=0.0),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=4,
        target_prompt_logprobs=types.TensorData.from_numpy(targets),
        prompt_logprobs_last_n=5,
    ).result()
    model = AutoModelForCausalLM.from_pretrained(base_folder("tiny", str(home / "model-cache")))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    full = torch.log_softmax(logits, dim=-1).numpy()  # row i: position i + 1
    first = len(ids) - 5
    lps = out.prompt_logprobs
    assert lps[:first] == [None] * first
    expected = [full[i - 1, ids[i]] for i in range(first, len(ids))]
    assert np.allclose(lps[first:], expected, atol=1e-4)
    topk = out.topk_prompt_logprobs
    assert topk[:first] == [None] * first
    for i in range(first, len(ids)):
        best = np.argsort(-full[i - 1])[:4]
        assert [t for t, _ in topk[i]] == best.tolist()
        assert np.allclose([v for _, v in topk[i]], full[i - 1, best], atol=1e-4)
    got = out.target_prompt_logprobs.to_numpy().reshape(targets.shape)
    want = np.where(targets < 0, 0.0, np.take_along_axis(full, np.maximum(targets, 0), axis=1))
    assert np.allclose(got, want, atol=1e-4)
    prompt = types.ModelInput.from_ints(ids)
    params = types.SamplingParams(max_tokens=1)
    for bad, word in (
        ({"topk_prompt_logprobs": 65}, "topk_prompt_logprobs must be 0..64"),
        ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": len(ids)}, "last_n"),
        ({"topk_sample_logprobs": 2}, "topk_sample_logprobs"),
    ):
        with pytest.raises(tinker.BadRequestError, match=word):
            sampler.sample(prompt, 1, params, **bad).result()


def test_top_k_distillation_targets_through_the_sdk(server: Server, tokenizer) -> None:
    """``cross_entropy`` on ``(n, K)`` targets and weights (a teacher's top k, as the
    cookbook's distillation sends them): the log-probs come back ``(n, K)``, each column that
    of the 1-D loss on it, and training on them raises the weighted targets' log-probs."""
    ids = tokenizer.encode("12+7=19")
    n = len(ids) - 1
    targets = np.stack([ids[1:], [5] * n], axis=1).astype(np.int64)
    weights = np.tile(np.array([[0.8, 0.2]], np.float32), (n, 1))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(targets),
            "weights": types.TensorData.from_numpy(weights),
        },
    )
    tc = server.client().create_lora_training_client(BASE, rank=4, seed=3).result()
    first = tc.forward([datum], "cross_entropy").result()
    lps = first.loss_fn_outputs[0]["logprobs"].to_numpy().reshape(n, 2)
    column = tc.forward(_datums(tokenizer, ["12+7=19"]), "cross_entropy").result()
    assert np.allclose(lps[:, 0], column.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-5)
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert after < first.metrics["loss:sum"]


def test_sparse_inputs_are_their_dense_tensors(server: Server, tokenizer) -> None:
    """The SDK sends 2-D ``target_tokens`` and ``weights`` that are mostly zeros as sparse CSR
    (``TensorData.from_torch_sparse``, as the cookbook's sdft and distillation do), and
    ``target_prompt_logprobs`` with -1 cells left out: each answers as its dense tensor does.
    Malformed CSR is a 400 naming it, and the session goes on."""
    import torch

    ids = tokenizer.encode("12+7=19")
    n = len(ids) - 1
    targets = np.zeros((n, 6), np.int64)
    weights = np.zeros((n, 6), np.float32)
    targets[:, 0], targets[::2, 1] = ids[1:], 5
    weights[:, 0], weights[::2, 1] = 0.7, 0.3
    model_input = types.ModelInput.from_ints(ids[:-1])

    def datum(encode) -> types.Datum:  # noqa: ANN001
        inputs = {"target_tokens": encode(targets), "weights": encode(weights)}
        return types.Datum(model_input=model_input, loss_fn_inputs=inputs)

    sparse = datum(lambda a: types.TensorData.from_torch_sparse(torch.from_numpy(a)))
    assert sparse.loss_fn_inputs["weights"].sparse_crow_indices is not None
    tc = server.client().create_lora_training_client(BASE, rank=4, seed=3).result()
    got = tc.forward([sparse], "cross_entropy").result()
    want = tc.forward([datum(types.TensorData.from_numpy)], "cross_entropy").result()
    assert got.metrics["loss:sum"] == want.metrics["loss:sum"]
    assert np.array_equal(
        got.loss_fn_outputs[0]["logprobs"].to_numpy(),
        want.loss_fn_outputs[0]["logprobs"].to_numpy(),
    )
    asks = np.full((len(ids) - 1, 4), -1, np.int64)
    asks[:, 0], asks[3, 2] = ids[1:], 9
    sampler = tc.save_weights_and_get_sampling_client().result()
    scored = [
        sampler.sample(model_input, 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=t)
        .result()
        .target_prompt_logprobs.to_numpy()
        for t in (
            types.TensorData.from_numpy(asks[: n - 1]),
            types.TensorData.from_torch_sparse(torch.from_numpy(asks[: n - 1]), pad_value=-1),
        )
    ]
    assert np.array_equal(*scored)
    crow = sparse.loss_fn_inputs["weights"].sparse_crow_indices
    nnz = crow[-1]
    for shape, bad, word in (
        ([n, 6], dict(sparse_crow_indices=crow, sparse_col_indices=[99] * nnz), "columns"),
        ([n, 6], dict(sparse_crow_indices=crow[:-1], sparse_col_indices=[0] * nnz), "pointers"),
        ([n, 10**9], dict(sparse_crow_indices=crow, sparse_col_indices=[0] * nnz), "cells"),
    ):
        hostile = types.TensorData(data=[1.0] * nnz, dtype="float32", shape=shape, **bad)
        inputs = {**sparse.loss_fn_inputs, "weights": hostile}
        with pytest.raises(tinker.BadRequestError, match=word):
            bad_datum = types.Datum(model_input=model_input, loss_fn_inputs=inputs)
            tc.forward([bad_datum], "cross_entropy").result()
    again = tc.forward([sparse], "cross_entropy").result()
    assert again.metrics["loss:sum"] == got.metrics["loss:sum"]


def test_checkpoint_ttls_and_publishing(server: Server) -> None:
    """A checkpoint saved with ``ttl_seconds`` lists when it expires (a TTL outside 1 hour to
    10 years is a 400); a name taken is a 400 unless ``overwrite``; ``set_checkpoint_ttl`` moves
    it; once past, the checkpoint is gone:
    not listed, its files deleted, a load of it a 404 saying it expired. A published
    checkpoint is one another key may sample; unpublished, it is private again."""
    from datetime import UTC, datetime, timedelta

    rest = server.client().create_rest_client()
    tc = server.client().create_lora_training_client(BASE, rank=2, seed=4).result()
    run_id = tc.get_info().model_id
    path = tc.save_weights_for_sampler("kept", ttl_seconds=7200).result().path
    (listed,) = [
        c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == path
    ]
    left = (listed.expires_at - datetime.now(UTC)).total_seconds()
    assert 7100 < left <= 7200 and listed.public is False
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be 3600"):
        tc.save_state("short", ttl_seconds=10).result()
    first = tc.save_state("state").result().path
    with pytest.raises(tinker.BadRequestError, match="overwrite=True replaces it"):
        tc.save_state("state").result()
    assert tc.save_state("state", overwrite=True).result().path == first
    rest.delete_checkpoint_from_tinker_path(first).result()
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    (listed,) = [
        c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == path
    ]
    assert (listed.expires_at - datetime.now(UTC)).total_seconds() <= 3600

    bob = server.client(BOB)
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=path).sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    rest.publish_checkpoint_from_tinker_path(path).result()
    assert [c.public for c in rest.list_checkpoints(run_id).result().checkpoints] == [True]
    out = (
        bob.create_sampling_client(model_path=path)
        .sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2))
        .result()
    )
    assert len(out.sequences[0].tokens) >= 1
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=path).sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)
        ).result()

    storage = server.service.storage
    _, _, folder = server.service.checkpoints.parse_path("alice", path)
    record = storage.read_json(f"{folder}/checkpoint.json")  # as if the hour had passed
    record["expires_at"] = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    storage.write_json(f"{folder}/checkpoint.json", record)
    assert server.service.checkpoints.sweep() == 1
    assert not storage.exists(folder)
    assert rest.list_checkpoints(run_id).result().checkpoints == []
    with pytest.raises(tinker.NotFoundError):
        server.client().create_sampling_client(model_path=path).sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)
        ).result()


def test_sessions_are_searched_by_name_project_metadata_and_status(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``search_sessions`` finds a key's own sessions, newest first: by display name (each
    word, any case) or id, project, user metadata, and status (running, or how its client
    closed it); a page at a time through ``next_cursor``; another key's never. A session
    keeps its client's tags (``TINKER_TAGS``)."""
    from tinker.types import (
        ActiveSessionStatusQuery,
        ClientFinishedSessionStatusQuery,
        SessionSearchRequest,
        UserSearchOwner,
    )

    tag = f"search-{time.time_ns()}"  # this test's sessions among the module's

    def opened(name: str, project: str | None) -> tinker.ServiceClient:
        client = tinker.ServiceClient(
            base_url=server.url,
            api_key=ALICE,
            project_id=project,
            display_name=name,
            user_metadata={"tag": tag},
        )
        client.create_lora_training_client(BASE, rank=2, seed=1).result()
        return client

    monkeypatch.setenv("TINKER_TAGS", "rl,nightly")
    nightly = opened("Nightly math RL", "proj-a")
    monkeypatch.delenv("TINKER_TAGS")
    sweep = opened("lr sweep", "proj-b")
    crashed = opened("nightly code RL", None)
    crashed.close("errored", "out of memory").result()
    server.clients += [nightly, sweep]
    rest = server.client().create_rest_client()

    def found(**kw) -> list[str]:
        page = rest.search_sessions(SessionSearchRequest(user_metadata={"tag": tag}, **kw))
        return [s.display_name for s in page.result().sessions]

    assert found() == ["nightly code RL", "lr sweep", "Nightly math RL"]
    assert found(display_name="NIGHTLY rl") == ["nightly code RL", "Nightly math RL"]
    assert found(project_ids=["proj-a", "default"]) == ["nightly code RL", "Nightly math RL"]
    assert found(statuses=[ActiveSessionStatusQuery()]) == ["lr sweep", "Nightly math RL"]
    errored = ClientFinishedSessionStatusQuery(reasons=["errored"])
    assert found(statuses=[errored]) == ["nightly code RL"]
    assert found(statuses=[ClientFinishedSessionStatusQuery(reasons=["success"])]) == []

    first = rest.search_sessions(SessionSearchRequest(user_metadata={"tag": tag}, limit=2))
    first = first.result()
    assert [s.display_name for s in first.sessions] == ["nightly code RL", "lr sweep"]
    (done,) = [s for s in first.sessions if s.display_name == "nightly code RL"]
    assert done.status.type == "client_finished" and done.status.reason.type == "errored"
    assert done.project_id == "default" and done.user_metadata == {"tag": tag}
    rest_page = SessionSearchRequest(user_metadata={"tag": tag}, limit=2, cursor=first.next_cursor)
    last = rest.search_sessions(rest_page).result()
    assert [s.display_name for s in last.sessions] == ["Nightly math RL"]
    assert last.next_cursor is None and last.sessions[0].owner == done.owner
    shown = httpx.get(
        f"{server.url}/api/v1/sessions/{last.sessions[0].session_id}",
        headers={"X-API-Key": ALICE},
        timeout=30,
    )
    assert shown.json()["tags"] == ["nightly", "rl"]

    bob = server.client(BOB).create_rest_client()
    assert (
        bob.search_sessions(SessionSearchRequest(user_metadata={"tag": tag})).result().sessions
        == []
    )
    others = SessionSearchRequest(owner=UserSearchOwner(owner_urns=["urn:flowrl:namespace:bob"]))
    assert rest.search_sessions(others).result().sessions == []
    bad = server.post("sessions/search", json={"limit": 0})
    assert bad.status_code == 400 and "limit" in bad.text


def test_copy_weights_makes_a_run_that_holds_the_checkpoint(server: Server, tokenizer) -> None:
    """``copy_weights`` puts a checkpoint into a new run of the caller's (in the project named,
    with its own TTL): it samples as the source did and outlives the source's deletion; the
    SDK's retry of one copy makes no second; another key's private checkpoint is not found;
    an access token, or no project, is a 400. ``get_info`` names the tokenizer."""
    client = server.client()
    tc = client.create_lora_training_client(BASE, rank=2, seed=5).result()
    info = server.post("get_info", json={"model_id": tc.get_info().model_id}).json()
    assert info["model_data"]["tokenizer_id"] == BASE
    source = tc.save_weights_for_sampler("to-copy").result().path
    rest = client.create_rest_client()
    copied = rest.copy_weights(source, "archive", ttl_seconds=7200).result()
    run_id = copied.split("/")[2]
    assert copied != source and copied.endswith("/sampler_weights/to-copy")
    (listed,) = rest.list_checkpoints(run_id).result().checkpoints
    assert listed.expires_at is not None and listed.public is False

    prompt = types.ModelInput.from_ints(tokenizer.encode("seven times seven"))
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)

    def tokens(path: str) -> list[int]:
        sampler = client.create_sampling_client(model_path=path)
        return sampler.sample(prompt, 1, greedy).result().sequences[0].tokens

    expected = tokens(source)
    rest.delete_checkpoint_from_tinker_path(source).result()
    assert tokens(copied) == expected

    body = {"source_path": copied, "destination_project_id": "archive"}
    key = {"X-Idempotency-Key": "same-copy"}
    once, again = (server.post("copy_weights", json=body, headers=key) for _ in range(2))
    assert once.status_code == 200 and once.json() == again.json()
    assert server.post("copy_weights", json=body, key=BOB).status_code == 404
    assert server.post("copy_weights", json={"source_path": copied}).status_code == 400
    token = {"X-Tinker-Weights-Access-Token": "t"}
    refused = server.post("copy_weights", json=body, headers=token)
    assert refused.status_code == 400 and "weights_access_token" in refused.text


def test_external_weights_download_into_peft_and_generate_as_the_sampler(
    server: Server, home: Path, tokenizer, tmp_path: Path
) -> None:
    """``save_weights_external`` exports a trained adapter as a PEFT folder; each file comes
    from its signed URL without a key (a changed or foreign token is a 403); ``PeftModel``
    loads it on the base, merged it generates with ``transformers`` the greedy tokens the
    service's sampler does. Encrypted to an age recipient, only its identity opens it."""
    import pyrage
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    client = server.client()
    tc = client.create_lora_training_client(BASE, rank=4, seed=3).result()
    for _ in range(4):
        tc.forward_backward(_datums(tokenizer, LINES), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    export = tc.save_weights_external("peft", ttl_seconds=3600).result().path
    assert export == f"tinker://{tc.get_info().model_id}/external_weights/peft"
    rest = client.create_rest_client()
    signed = rest.get_external_weights_urls(export).result()
    assert sorted(signed.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    folder = tmp_path / "adapter"
    folder.mkdir()
    for name, url in signed.urls.items():
        got = httpx.get(url, timeout=30)  # no key: the URL is the permission
        assert got.status_code == 200, got.text
        (folder / name).write_bytes(got.content)
    forged = signed.urls["adapter_config.json"][:-4] + "0000"
    assert httpx.get(forged, timeout=30).status_code == 403

    prompt = tokenizer.encode("12+7=")
    sampler = tc.save_weights_and_get_sampling_client()
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    served = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
    base = AutoModelForCausalLM.from_pretrained(base_folder("tiny", str(home / "model-cache")))
    # The tiny base ties its unembedding to its embedding; the adapter trains the unembedding
    # (lm_head), so merging it needs the two apart, or it would change the embedding too.
    base.lm_head.weight = torch.nn.Parameter(base.get_input_embeddings().weight.detach().clone())
    base.config.tie_word_embeddings = False
    peft = PeftModel.from_pretrained(base, str(folder))
    merged = peft.merge_and_unload()
    with torch.no_grad():
        out = merged.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert out[0, len(prompt) :].tolist() == served.sequences[0].tokens

    identity = pyrage.x25519.Identity.generate()
    sealed = tc.save_weights_external(
        "sealed", age_encryption_recipients=[str(identity.to_public())]
    )
    sealed_urls = rest.get_external_weights_urls(sealed.result().path).result().urls
    assert sorted(sealed_urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    blob = httpx.get(sealed_urls["adapter_config.json.age"], timeout=30).content
    assert pyrage.decrypt(blob, [identity]) == (folder / "adapter_config.json").read_bytes()
    with pytest.raises(tinker.BadRequestError, match="not an age recipient"):
        tc.save_weights_external("bad", age_encryption_recipients=["age1nope"]).result()
    with pytest.raises(tinker.BadRequestError, match="is for download"):
        client.create_training_client_from_state(export).result()
    run_id = export.split("/")[2]
    urls_of = f"{server.url}/api/v1/training_runs/{run_id}/checkpoints/external_weights/peft/"
    bobs = httpx.get(f"{urls_of}external_weights_urls", headers={"X-API-Key": BOB}, timeout=30)
    assert bobs.status_code == 404  # another key's export
