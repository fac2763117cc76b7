"""``flowrl serve openai`` through the official ``openai`` client (3.57): a registered version of
namespace ``alice`` (a short rl-train job) and a Tinker sampler checkpoint of hers are listed,
completed and streamed; greedy answers are ``batch-inference``'s and the Tinker SDK's; another
key's models are not found; bad input is a 4xx naming it, and the endpoint serves on."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from services import AppServer

from flowrl.tasks.schemas import load_job

ALICE = "alice-key-" + "a" * 24
BOB = "bob-key-" + "b" * 24


@pytest.fixture(scope="module")
def alice_version(prefect_api, flowrl_home) -> Iterator[str]:
    """``models:/openai-src/1`` of namespace alice: a 2-step rl-train job's version."""
    from flowrl.flows.rl import rl_train

    saved = os.environ.get("FLOWRL_NAMESPACE")
    os.environ["FLOWRL_NAMESPACE"] = "alice"
    try:
        config = load_job(
            None,
            [
                "name=openai-src",
                "env.params.eval_size=16",
                "rollout.prompts_per_step=8",
                "schedule.steps=2",
                "schedule.eval_every=2",
                "schedule.checkpoint_every=2",
            ],
        )
        result = rl_train(config)
    finally:
        if saved is None:
            os.environ.pop("FLOWRL_NAMESPACE", None)
        else:
            os.environ["FLOWRL_NAMESPACE"] = saved
    assert result.model_uri == "models:/alice_openai-src/1"
    yield "models:/openai-src/1"


@pytest.fixture(scope="module")
def endpoint(flowrl_home) -> Iterator[AppServer]:
    from flowrl.backends.services.openai_api.routes import create_app
    from flowrl.backends.services.openai_api.service import Limits, OpenAIService

    service = OpenAIService(keys={ALICE: "alice", BOB: "bob"}, limits=Limits(max_n=4))
    server = AppServer(create_app(service))
    yield server
    server.stop()


def _client(endpoint: AppServer, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint.url}/v1", api_key=key, max_retries=0)


def test_the_openai_client_lists_completes_and_streams_a_registered_version(
    endpoint, alice_version
):
    client = _client(endpoint)
    ids = [m.id for m in client.models.list()]
    assert "flowrl/tiny" in ids and alice_version in ids
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    answer = client.chat.completions.create(
        model=alice_version, messages=messages, temperature=0, max_tokens=8, logprobs=True
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    assert 0 < answer.usage.completion_tokens <= 8
    tokens = choice.model_extra["token_ids"]
    assert len(choice.logprobs.content) == len(tokens) == answer.usage.completion_tokens
    assert all(t.logprob <= 0 for t in choice.logprobs.content)

    streamed = client.chat.completions.create(
        model=alice_version, messages=messages, temperature=0, max_tokens=8, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == choice.message.content

    several = client.chat.completions.create(
        model=alice_version, messages=messages, temperature=1.0, max_tokens=8, n=3, seed=5
    )
    again = client.chat.completions.create(
        model=alice_version, messages=messages, temperature=1.0, max_tokens=8, n=3, seed=5
    )
    assert len(several.choices) == 3
    assert [c.message.content for c in several.choices] == [
        c.message.content for c in again.choices
    ]

    completion = client.completions.create(model="flowrl/tiny", prompt="12+7=", max_tokens=4)
    assert len(completion.choices) == 1 and completion.usage.completion_tokens <= 4


def test_greedy_answers_are_batch_inference_answers(endpoint, alice_version):
    """The held-out episodes of ``batch-inference`` on the version, asked again through the
    endpoint with their own opening messages: the same greedy answers."""
    from flowrl.flows.inference import batch_inference
    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage
    from flowrl.tasks.schemas import InferenceJobConfig

    saved = os.environ.get("FLOWRL_NAMESPACE")
    os.environ["FLOWRL_NAMESPACE"] = "alice"
    try:
        scoped = alice_version.replace("models:/", "models:/alice_")  # a job names it in full
        config = InferenceJobConfig(name="openai-greedy", model=scoped, num_prompts=6)
        batch_inference(config)
        lines = Storage(get_settings().storage_root).read_bytes(
            "ns/alice/jobs/openai-greedy/inference/trajectories.jsonl"
        )
    finally:
        if saved is None:
            os.environ.pop("FLOWRL_NAMESPACE", None)
        else:
            os.environ["FLOWRL_NAMESPACE"] = saved
    client = _client(endpoint)
    episodes = [json.loads(line) for line in lines.splitlines()]
    assert len(episodes) == 6
    for episode in episodes:
        opening, reply = episode["messages"][:-1], episode["messages"][-1]
        answer = client.chat.completions.create(
            model=alice_version,
            messages=opening,
            temperature=0,
            max_tokens=config.rollout.max_new_tokens,
        )
        assert answer.choices[0].message.content == reply["content"]


def test_a_tinker_sampler_checkpoint_is_served(endpoint, flowrl_home):
    """A LoRA trained through the Tinker SDK and saved for sampling: the endpoint's greedy
    token ids for it are the Tinker sampling client's."""
    import tinker
    from services import TinkerServer
    from tinker import types

    from flowrl.backends.models.model_folder import load_tokenizer
    from flowrl.backends.models.tinker_checkpoints import resolve_base_model
    from flowrl.backends.policy.placement import InProcess
    from flowrl.backends.services.tinker.service import TinkerService
    from flowrl.infra.settings import get_settings

    key = "tml-alice-" + "a" * 24
    tinker_server = TinkerServer(TinkerService(InProcess(), keys={key: "alice"}))
    client = tinker.ServiceClient(base_url=tinker_server.url, api_key=key)
    try:
        tokenizer = load_tokenizer(resolve_base_model("tiny", get_settings().model_cache_dir))
        tc = client.create_lora_training_client("flowrl/tiny", rank=4, seed=1).result()
        data = []
        for line in ["12+7=19", "3+4=7", "5+5=10"]:
            ids = tokenizer.encode(line)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
                )
            )
        for _ in range(4):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler("served").result().path
        prompt = tokenizer.encode("12+7=")
        sampler = client.create_sampling_client(model_path=path).result()
        greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
        expected = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
    finally:
        client.close("success").result()
        tinker_server.stop()
    answer = _client(endpoint).completions.create(
        model=path, prompt=prompt, max_tokens=5, temperature=0
    )
    assert answer.choices[0].model_extra["token_ids"] == expected.sequences[0].tokens
    with pytest.raises(openai.NotFoundError):  # bob's namespace holds no such checkpoint
        _client(endpoint, BOB).completions.create(model=path, prompt=prompt, max_tokens=2)


def test_a_running_jobs_current_policy_is_served(endpoint, prefect_api):
    """``job:<name>`` while alice's job trains: listed for her and not for bob, answered by the
    job's own sampler with the weights it last synced (the fingerprint's version rises as the
    job trains); once the job has ended, a 404 naming it."""
    from flowrl.flows.rl import rl_train

    config = load_job(
        None,
        [
            "name=openai-live",
            "env.params.eval_size=16",
            "rollout.prompts_per_step=8",
            "schedule.steps=200",  # ~0.1 s a step here: long enough to be seen training
            "schedule.eval_every=200",
            "schedule.checkpoint_every=200",
        ],
    )
    outcome: dict = {}

    def run_job() -> None:  # on the session's Ray, which the endpoint in this process shares
        try:
            outcome["result"] = rl_train(config)
        except BaseException as err:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = err

    alice, bob = _client(endpoint), _client(endpoint, BOB)
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    saved = os.environ.get("FLOWRL_NAMESPACE")
    os.environ["FLOWRL_NAMESPACE"] = "alice"
    job = threading.Thread(target=run_job)
    job.start()
    try:
        deadline = time.monotonic() + 300
        while "job:openai-live" not in [m.id for m in alice.models.list()]:
            assert job.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.2)
        assert "job:openai-live" not in [m.id for m in bob.models.list()]
        with pytest.raises(openai.NotFoundError) as refused:
            bob.chat.completions.create(model="job:openai-live", messages=messages, max_tokens=4)
        assert "job:openai-live" in refused.value.response.text
        versions = []
        while len(set(versions)) < 3:  # three different weights answered, in order
            answer = alice.chat.completions.create(
                model="job:openai-live", messages=messages, temperature=0, max_tokens=6
            )
            assert answer.model == "job:openai-live" and answer.choices[0].finish_reason
            assert 0 < answer.usage.completion_tokens <= 6
            versions.append(int(answer.system_fingerprint.removeprefix("weights-")))
            assert job.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.2)
        assert versions == sorted(versions)
    finally:
        job.join(timeout=600)
        if saved is None:
            os.environ.pop("FLOWRL_NAMESPACE", None)
        else:
            os.environ["FLOWRL_NAMESPACE"] = saved
    assert "error" not in outcome, outcome
    assert outcome["result"].model_uri == "models:/alice_openai-live/1"
    assert "job:openai-live" not in [m.id for m in alice.models.list()]
    with pytest.raises(openai.NotFoundError) as ended:
        alice.chat.completions.create(model="job:openai-live", messages=messages, max_tokens=4)
    assert "no running job" in ended.value.response.text


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        (
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "no-such-model",
        ),
        (
            {"model": "/etc/passwd", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "/etc/passwd",
        ),
        (
            {"model": "job:no-such-job", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "job:no-such-job",
        ),
        (
            {"model": "job:../../x", "messages": [{"role": "user", "content": "hi"}]},
            400,
            "job:<job name>",
        ),
        ({"model": "flowrl/tiny", "messages": "hi"}, 400, "messages"),
        ({"model": "flowrl/tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        (
            {"model": "flowrl/tiny", "messages": [{"role": "user", "content": "hi"}], "n": 100},
            400,
            "n:",
        ),
        (
            {"model": "flowrl/tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5},
            400,
            "top_p",
        ),
        (
            {
                "model": "flowrl/tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "logit_bias": {"1": 5},
            },
            400,
            "logit_bias",
        ),
        (
            {
                "model": "flowrl/tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            400,
            "tools",
        ),
        (
            {
                "model": "flowrl/tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 100000,
            },
            400,
            "max_tokens",
        ),
        (
            {"model": "flowrl/tiny", "messages": [{"role": "user", "content": "x" * 5000}]},
            400,
            "context",
        ),
    ],
)
def test_bad_input_is_a_4xx_naming_it_and_the_endpoint_serves_on(endpoint, body, status, names):
    headers = {"Authorization": f"Bearer {ALICE}"}
    response = httpx.post(
        f"{endpoint.url}/v1/chat/completions", json=body, headers=headers, timeout=60
    )
    assert response.status_code == status, response.text
    assert names in response.json()["detail"]
    ok = httpx.post(
        f"{endpoint.url}/v1/chat/completions",
        json={
            "model": "flowrl/tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        },
        headers=headers,
        timeout=60,
    )
    assert ok.status_code == 200


def test_malformed_bodies_and_missing_keys_are_refused(endpoint):
    url = f"{endpoint.url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"}
    assert httpx.post(url, content=b"{not json", headers=headers).status_code == 422
    assert httpx.post(url, content=b"[1, 2]", headers=headers).status_code == 422
    assert httpx.post(url, json={"model": "flowrl/tiny"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(endpoint, "wrong-key-" + "x" * 20).models.list()
