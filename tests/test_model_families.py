"""Real chat-model families (ChatML/Qwen2.5, Qwen3, Llama 3, Gemma 3, Mistral instruct) render
multi-turn episodes token-exactly: fixtures from ``tests/families.py``, the real HF sampler and
trainer. The strict families (Gemma 3, Mistral) get tool results as user turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import BROKEN, FAMILIES, NO_SYSTEM, STRICT, build_family, teach

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.agent_loop.types import StopReason
from flowrl.backends.engines.hf_sampler import HFSampler
from flowrl.backends.models.chat import (
    ChatTemplateError,
    ConversationNeeds,
    HFChatFormat,
    check_chat_template,
    generation_eos_ids,
    probe,
)
from flowrl.backends.policy.actors import sampler, start_policy, stop_policy, sync_weights, trainer
from flowrl.backends.types import Datum, WorkerSpec
from flowrl.cli import main
from flowrl.environments.plugin import first_user_message
from flowrl.environments.registry import make_env, make_task
from flowrl.tasks.sft import sft_datum

CALL = '<tool_call>{"expr": "1+2"}</tool_call>'
REPLIES = {"chatml": CALL, "llama3": CALL, "qwen3": f"<think>\nI add.\n</think>\n\n{CALL}",
           "gemma3": CALL, "mistral": CALL}  # fmt: skip
"""What each taught fixture answers, every turn: a calculator call (an invalid gomoku move)."""
EPISODES = {
    # tool_math: every reply is a tool call, so the episode runs until max_turns.
    "tool_math": ({"max_tool_calls": 2}, LoopLimits(3, 48, 2048, 0.0), StopReason.MAX_TURNS),
    # gomoku: every reply is an invalid move; the third forfeits the game.
    "gomoku": ({"size": 5, "win_length": 3, "max_invalid_moves": 3}, LoopLimits(5, 48, 2048, 0.0),
               StopReason.DONE),
}  # fmt: skip
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tool-math.yaml"
SYSTEM_HEADER = {"chatml": "<|im_start|>system", "qwen3": "<|im_start|>system",
                 "llama3": "<|start_header_id|>system"}  # fmt: skip
"""The system turn's header; the strict families fold the system prompt into the first user
turn, so for them the prompt's own text is counted."""
E2E_FAMILIES = ("chatml", "llama3", "qwen3")
"""The families the end-to-end test trains from a folder and from S3; of the strict ones it
trains Gemma 3 from a folder only (their rendering is checked by the episode tests above)."""


def scripted(chat: HFChatFormat, env_name: str, params: dict, reply: str, turns: int):
    """The episode the loop should produce when the policy answers ``reply`` every turn, as
    (tokens, mask): the target a fixture is taught."""
    env = make_env(env_name, params)
    row = make_task(env_name, params).eval_set()[0]
    opening = (
        [{"role": "system", "content": env.get_system_prompt()}] if env.get_system_prompt() else []
    )
    opening.append({"role": "user", "content": first_user_message(env, env.reset(**row))})
    messages = [*opening]
    for _ in range(turns):
        messages.append({"role": "assistant", "content": reply})
        step = env.step(chat.response(reply))
        if step.done:
            break
        messages.append(
            {"role": step.info.get("observation_role", "user"), "content": step.observation}
        )
    datum = sft_datum(chat, messages)
    return datum.tokens, datum.loss_mask


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, str]:
    """(family name, folder) of a fixture taught to answer its episodes with ``REPLIES``."""
    name = request.param
    folder = build_family(FAMILIES[name], tmp_path_factory.mktemp(name))
    chat = HFChatFormat.from_folder(folder)
    data = [scripted(chat, env, params, REPLIES[name], limits.max_turns)
            for env, (params, limits, _) in EPISODES.items()]  # fmt: skip
    teach(folder, [t for t, _ in data], [m for _, m in data])
    return name, folder


def whole(chat: HFChatFormat, messages: list[dict]) -> list[int]:
    """The conversation rendered at once by the model's own template (tool results as the
    chat format gives them to it: user turns for the strict families)."""
    return chat.tokenizer.apply_chat_template(
        chat.template_messages(messages), tokenize=True, return_dict=False
    )


def without_stripped_thinking(chat: HFChatFormat, tokens: list[int], messages: list[dict]):
    """Qwen3's documented equivalent: the trained tokens without the ``<think>`` blocks (and the
    blank line after them) of the assistant turns before the last user message, which the
    template drops and the policy keeps."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    n = sum(1 for m in messages[:last_user] if m["role"] == "assistant")
    open_id, close_id = chat.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    out, i = [], 0
    while i < len(tokens):
        if tokens[i] == open_id and n > 0:
            j = tokens.index(close_id, i) + 1
            while chat.tokenizer.decode(tokens[j : j + 1]).strip("\n") == "":
                j += 1
            i, n = j, n - 1
            continue
        out.append(tokens[i])
        i += 1
    return out


@pytest.mark.parametrize("env_name", sorted(EPISODES))
def test_multi_turn_episodes_are_the_templates_own_tokens(family, env_name, tmp_path):
    name, folder = family
    chat = HFChatFormat.from_folder(folder)
    params, limits, reason = EPISODES[env_name]
    hf = HFSampler(WorkerSpec(model_uri=folder, cache_dir=str(tmp_path)))
    rows = make_task(env_name, params).eval_set()[:1]
    [traj] = run_episodes([make_env(env_name, params)], rows, [0], hf, chat, limits)

    assert traj.stop_reason is reason and traj.info["num_turns"] == 3, traj.messages
    assert [m["content"] for m in traj.messages if m["role"] == "assistant"] == [REPLIES[name]] * 3
    reference = whole(chat, traj.messages)
    trained = traj.tokens
    if name == "qwen3" and env_name == "gomoku":  # earlier turns' <think> kept, as sampled
        trained = without_stripped_thinking(chat, trained, traj.messages)
        assert len(trained) < len(traj.tokens)
    # The whole rendering may add only the separator after the last end-of-turn token.
    assert reference[: len(trained)] == trained
    assert chat.tokenizer.decode(reference[len(trained) :]).strip() == ""
    text, reference_text = chat.tokenizer.decode(trained), chat.tokenizer.decode(reference)
    system = SYSTEM_HEADER.get(name, traj.messages[0]["content"])
    assert text.count(system) == reference_text.count(system) == 1
    bos = chat.tokenizer.bos_token_id
    if bos is not None:
        assert traj.tokens.count(bos) == reference.count(bos) == 1 and traj.tokens[0] == bos
    # Sampled turns are the mask-1 tokens, each ending with the end-of-turn token.
    sampled = [t for t, m in zip(traj.tokens, traj.loss_mask, strict=True) if m]
    assert sampled.count(chat.end_of_turn_id) == 3


def test_qwen3_documented_difference_think_blocks_of_earlier_turns(tmp_path):
    """Qwen3's template drops an earlier turn's <think> block once a user message follows; the
    loop keeps the turn as sampled (the trained stream is the sampled stream)."""
    folder = build_family(FAMILIES["qwen3"], tmp_path)
    chat = HFChatFormat.from_folder(folder)
    reply = "<think>\nthink first\n</think>\n\nanswer"
    assert chat.response(reply) == "answer"
    opening = [{"role": "user", "content": "q1"}]
    tokens = chat.encode_prompt(opening) + chat.encode_reply(reply)
    tokens += chat.encode_turn({"role": "user", "content": "q2"})
    rendered = chat.tokenizer.decode(whole(chat, [*opening, {"role": "assistant", "content": reply},
                                                  {"role": "user", "content": "q2"}]))  # fmt: skip
    assert "think first" in chat.tokenizer.decode(tokens) and "think first" not in rendered


def test_the_sampler_stops_on_every_eos_id_of_the_generation_config(family, tmp_path):
    name, folder = family
    eos_ids = generation_eos_ids(folder)
    assert len(eos_ids) >= (1 if name == "mistral" else 2)
    hf = HFSampler(WorkerSpec(model_uri=folder, cache_dir=str(tmp_path)))
    assert set(eos_ids) <= set(hf.stop_token_ids)
    chat = HFChatFormat.from_folder(folder)
    prompt = chat.encode_prompt([{"role": "user", "content": "Stop now."}])
    head = hf.model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    biased.weight = head.weight
    hf.model.set_output_embeddings(biased)
    plain = chat.tokenizer.convert_tokens_to_ids("a")
    for token_id in [*eos_ids, plain]:
        with torch.no_grad():
            biased.bias.zero_()
            biased.bias[token_id] = 1e4  # the model now always says token_id
        [result] = hf.sample([prompt], 8, 1.0, seed=0)
        if token_id == plain:
            assert result.tokens == [plain] * 8 and result.finish_reason == "length"
        else:
            assert result.tokens == [token_id] and result.finish_reason == "stop", token_id


def test_sampler_and_trainer_logprobs_agree_after_a_weight_sync(family, tmp_path):
    name, folder = family
    chat = HFChatFormat.from_folder(folder)
    prompts = [chat.encode_prompt([{"role": "user", "content": q}]) for q in ("1+1?", "Hi there")]
    spec = WorkerSpec(model_uri=folder, cache_dir=str(tmp_path / "cache"), learning_rate=1e-2)
    ref = start_policy(f"family-{name}", spec, local=True)
    try:
        first = sampler(ref).sample(prompts, 12, 1.0, seed=1)
        data = [Datum(p + r.tokens, [0] * len(p) + [1] * len(r.tokens), advantage=1.0,
                      old_logprobs=[0.0] * len(p) + r.logprobs)
                for p, r in zip(prompts, first, strict=True)]  # fmt: skip
        trainer(ref).forward_backward(data, "ppo_clip")
        trainer(ref).optim_step()
        assert sync_weights(ref) == 1
        results = sampler(ref).sample(prompts, 12, 1.0, seed=2)
        data = [Datum(p + r.tokens, [0] * len(p) + [1] * len(r.tokens))
                for p, r in zip(prompts, results, strict=True)]  # fmt: skip
        rows = trainer(ref).compute_logprobs(data, 1.0)
        for p, r, row in zip(prompts, results, rows, strict=True):
            torch.testing.assert_close(
                torch.tensor(r.logprobs), torch.tensor(row[len(p) :]), atol=1e-5, rtol=0
            )
    finally:
        stop_policy(ref)


def test_a_template_that_cannot_render_incrementally_is_refused(tmp_path, monkeypatch, capsys):
    folder = build_family(BROKEN, tmp_path / "counting")
    with pytest.raises(ChatTemplateError) as err:
        check_chat_template(folder)
    message = str(err.value)
    assert folder in message and "first differs at token" in message
    assert "has 2 message" in message and "has 6 messag" in message  # decoded, both sides
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "home"))
    assert main(["train", str(CONFIG), "--set", f"model.source={folder}"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "home").exists()  # refused before any store, server or worker
    for name in FAMILIES:  # the supported families pass the same probe
        probe(HFChatFormat.from_folder(build_family(FAMILIES[name], tmp_path / name)))


def test_chat_format_names_a_family_and_refuses_a_mismatch(tmp_path):
    folder = build_family(FAMILIES["llama3"], tmp_path / "llama3")
    assert HFChatFormat.from_folder(folder).family.name == "llama3"
    assert HFChatFormat.from_folder(folder, chat_format="template").family.name == "template"
    with pytest.raises(ChatTemplateError, match="'chatml' ends an assistant turn with"):
        HFChatFormat.from_folder(folder, chat_format="chatml")
    config = json.loads((Path(folder) / "generation_config.json").read_text())
    assert HFChatFormat.from_folder(folder).stop_token_ids[0] == config["eos_token_id"][-1]


def test_strict_families_get_tool_results_as_user_turns_token_exactly(tmp_path):
    """Gemma 3 and Mistral refuse a tool message: ``auto`` renders it as a user turn (the
    conversation alternates), ``model.tool_messages=user`` does so for any family, and either
    passes the probe of a system prompt, user and tool observations."""
    opening = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    for name in (*STRICT, "chatml"):
        folder = build_family(FAMILIES[name], tmp_path / name)
        assert HFChatFormat.from_folder(folder).tool_role == ("user" if name in STRICT else "tool")
        chat = HFChatFormat.from_folder(folder, tool_messages="user")
        probe(chat, ConversationNeeds())
        tool, user = {"role": "tool", "content": "42"}, {"role": "user", "content": "42"}
        assert chat.encode_turn(tool) == chat.encode_turn(user)
        if name == "gemma3":  # the system prompt folded into the first user turn
            assert chat.tokenizer.decode(chat.encode_prompt(opening)) == (
                "<bos><start_of_turn>user\nS\n\nQ<end_of_turn>\n<start_of_turn>model\n"
            )
            assert chat.tokenizer.decode(chat.encode_turn(tool)) == (
                "\n<start_of_turn>user\n42<end_of_turn>\n<start_of_turn>model\n"
            )
        if name == "mistral":
            assert chat.tokenizer.decode(chat.encode_prompt(opening)) == "<s>[INST] S\n\nQ [/INST]"
            assert chat.tokenizer.decode(chat.encode_turn(tool)) == "[INST] 42 [/INST]"


def test_train_refuses_a_role_the_template_refuses_with_exit_2(tmp_path, monkeypatch, capsys):
    """tool_math answers with tool messages; Gemma 3's template refuses them, and with the
    user-turn fallback off ``flowrl train`` exits 2 naming the folder, the role and the turn
    order (no traceback). What the environment never sends is not probed."""
    folder = build_family(FAMILIES["gemma3"], tmp_path / "gemma3")
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "home"))
    overrides = ["--set", f"model.source={folder}", "--set", "model.tool_messages=tool"]
    capsys.readouterr()  # the fixture build's progress bars
    assert main(["train", str(CONFIG), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flowrl: model folder {folder}: its chat template refuses a 'tool'")
    assert "(turn order system -> user -> assistant -> tool)" in err
    assert "set model.tool_messages: user" in err and "Traceback" not in err
    assert not (tmp_path / "home").exists()  # refused before any store, server or worker
    gomoku = make_task("gomoku", EPISODES["gomoku"][0])  # user observations only: accepted
    check_chat_template(folder, tool_messages="tool", task=gomoku)
    # A template refusing a system prompt: refused for an environment that has one only.
    no_system = build_family(NO_SYSTEM, tmp_path / "no-system")
    with pytest.raises(ChatTemplateError, match=r"refuses a 'system' message \(turn order system"):
        check_chat_template(no_system, task=make_task("tool_math", EPISODES["tool_math"][0]))
    check_chat_template(no_system, task=make_task("arithmetic", {}))  # no system prompt


FAMILY_JOBS_SCRIPT = """
import json, sys
import mlflow
import ray
from flowrl.backends.models.chat import HFChatFormat, generation_eos_ids
from flowrl.backends.models.model_folder import load_tokenizer
from flowrl.backends.models.model_uri import resolve_model_uri
from flowrl.flows.rl import rl_train
from flowrl.infra.settings import get_settings
from flowrl.tasks.schemas import load_job

settings = get_settings()
settings.apply_to_environment()
ray.init(num_cpus=4, include_dashboard=False, namespace="flowrl", log_to_driver=False)
results = {}
for job in json.loads(sys.argv[1]):
    result = rl_train(load_job(sys.argv[2], job["overrides"]))
    registered = resolve_model_uri(result.model_uri, settings.model_cache_dir)
    base, back = load_tokenizer(job["folder"]), load_tokenizer(registered)
    text = "<|im_start|>user\\nWhat is 12 * 34?<think>" + json.dumps({"x": 1})
    turns = mlflow.tracking.MlflowClient().get_metric_history(result.mlflow_run_id, "env/num_turns")
    results[job["key"]] = {
        "model_uri": result.model_uri,
        "template": back.chat_template == base.chat_template,
        "vocab": back.get_vocab() == base.get_vocab(),
        "encode": back.encode(text) == base.encode(text),
        "eos": generation_eos_ids(registered) == generation_eos_ids(job["folder"]),
        "stops": HFChatFormat.from_folder(registered).stop_token_ids
        == HFChatFormat.from_folder(job["folder"]).stop_token_ids,
        "turns": max(m.value for m in turns),
    }
print("RESULTS " + json.dumps(results))
"""


def test_an_rl_job_trains_each_family_from_a_folder_and_from_s3_and_registers_it(
    moto_s3, tmp_path, prefect_api
):
    """Seven short multi-turn tool_math jobs (three families x local folder / s3:// copy on moto,
    and Gemma 3 from a folder, its tool results as user turns) in one Python process, on the
    session's Prefect API; each registered version reloads with its base's tokenizer, chat
    template and generation config."""
    import os
    import subprocess
    import sys

    import fsspec
    from prefect.settings import PREFECT_API_URL

    from flowrl.backends.models.chat import HFChatFormat as Format

    params, limits, _ = EPISODES["tool_math"]
    jobs = []
    for name in (*E2E_FAMILIES, "gemma3"):
        folder = build_family(FAMILIES[name], tmp_path / name)
        chat = Format.from_folder(folder)
        tokens, mask = scripted(chat, "tool_math", params, REPLIES[name], limits.max_turns)
        teach(folder, [tokens], [mask])
        sources = [("local", folder)]
        if name in E2E_FAMILIES:
            url = f"s3://{moto_s3.bucket}/families/{name}"
            fsspec.filesystem("s3").put(f"{folder}/", url, recursive=True)
            sources.append(("s3", url))
        for where, source in sources:
            overrides = [
                f"name=family-{name}-{where}",
                f"model.source={source}",
                "warmup.enabled=false",
                "schedule.steps=2",
                "schedule.eval_every=2",
                "schedule.checkpoint_every=2",
                "rollout.prompts_per_step=2",
                "rollout.group_size=2",
                "rollout.max_context_tokens=512",
                "env.params.eval_size=4",
            ]
            jobs.append({"key": f"{name}/{where}", "folder": folder, "overrides": overrides})
    env = dict(os.environ, FLOWRL_HOME=str(tmp_path / "home"))
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()  # no cold start of a Prefect API
    done = subprocess.run(
        [sys.executable, "-c", FAMILY_JOBS_SCRIPT, json.dumps(jobs), str(CONFIG)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS ") :])
    assert sorted(results) == sorted(job["key"] for job in jobs)
    for key, result in results.items():
        assert result["model_uri"].startswith("models:/family-"), key
        checks = ("template", "vocab", "encode", "eos", "stops")
        assert all(result[c] for c in checks), (key, result)
        assert result["turns"] > 1, (key, result)  # multi-turn episodes
