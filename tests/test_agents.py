"""Agents as rollouts (``env.name: agent:<module>:<function>``): the user's agent, written with
the ``openai`` client, plays a task through rollout sessions over real HTTP; its episodes are
scored, recorded token for token, and fail alone.

The sampler here answers by rule (``sample_agents.RuleSampler``) so that what is checked is the
runner: sessions, scoring, failures, budgets and keys. The token-exact recording on real model
families is tests/test_agent_sessions.py; learning is tests/test_agent_training.py.
"""

from __future__ import annotations

import time

import pytest
import sample_agents
from fakes import END, ByteChat, say
from sample_agents import LOGPROB, RuleSampler

from flowrl.agent_loop.loop import LoopLimits
from flowrl.agent_loop.types import StopReason
from flowrl.environments.registry import make_task
from flowrl.tasks.agent_episodes import run_agent_episodes

ROWS = [{"target": 7}, {"target": 3}]
LIMITS = LoopLimits(max_turns=3, max_new_tokens=8, max_context_tokens=120, temperature=1.0)


def _task(agent: str, **params):  # noqa: ANN003 - env.params
    return make_task(f"agent:sample_agents:{agent}", {"task": "fakes:GuessNumberEnv", **params})


def _play(task, rows=ROWS, group_ids=None, sampler=None, limits=LIMITS):  # noqa: ANN001
    group_ids = group_ids or list(range(len(rows)))
    ids = [f"e{i}" for i in range(len(rows))]
    sampler = sampler or RuleSampler()
    return run_agent_episodes(task, rows, group_ids, sampler, ByteChat(), limits, ids), sampler


def test_answers_are_scored_by_the_task_and_trained_as_the_tokens_sampled():
    (right, wrong), sampler = _play(_task("answer_once"))
    assert (right.reward, wrong.reward) == (1.0, 0.0)  # the task's step("7") on targets 7 and 3
    assert right.info["correct"] is True and right.info["requests"] == 1
    assert right.stop_reason is StopReason.DONE and not right.failed
    opening = ByteChat().encode_prompt([{"role": "user", "content": "guess 0-9"}])
    assert right.tokens == opening + say("7")
    assert right.loss_mask == [0] * len(opening) + [1, 1]
    assert right.logprobs == [0.0] * len(opening) + [LOGPROB, LOGPROB]
    assert sampler.prompts == [opening, opening]


def test_a_multi_turn_agent_is_one_trajectory_with_masks_over_its_answers():
    answers = iter(["5", "6", "7", "1", "2", "3"])
    sampler = RuleSampler(lambda _text: next(answers))
    (t,), _ = _play(_task("guess_until_right"), rows=[{"target": 7}], sampler=sampler)
    sampled = [tok for tok, m in zip(t.tokens, t.loss_mask, strict=True) if m]
    assert sampled == say("5") + say("6") + say("7")
    assert t.info["requests"] == 3 and t.reward == 1.0  # its last guess, scored by the task
    assert t.tokens[: t.prompt_len] == sampler.prompts[0]
    assert t.tokens[: len(sampler.prompts[2])] == sampler.prompts[2]  # prompts extend, exactly


def test_a_plain_function_agent_with_the_sync_client_runs_too():
    (right, wrong), _ = _play(_task("answer_once_blocking"))
    assert (right.reward, wrong.reward) == (1.0, 0.0)


def test_a_number_the_agent_returns_is_the_reward_and_a_reward_function_overrides_it():
    (a, b), _ = _play(_task("own_reward"))
    assert (a.reward, b.reward) == (1.75, 0.75)
    (a, b), _ = _play(_task("answer_once", reward="sample_agents:reward_by_length"))
    assert (a.reward, b.reward) == (1.0, 1.0)  # len("7")


@pytest.mark.parametrize(
    ("agent", "why"),
    [
        ("raises", "RuntimeError: agent bug"),
        ("returns_a_list", "the agent returned list: return a reward (a number) or the final"),
    ],
)
def test_a_failing_agent_fails_its_episode_with_the_reason(agent, why):
    episodes, _ = _play(_task(agent))
    assert all(t.failed and why in t.info["error"] for t in episodes)


def test_a_failing_task_environment_fails_the_episode_not_the_batch():
    task = make_task(
        "agent:sample_agents:answer_once",
        {"task": "fakes:RaisingEnv", "task_params": {"fail_in": "step"}},
    )
    episodes, _ = _play(task)
    assert all(t.failed and "ZeroDivisionError: env bug" in t.info["error"] for t in episodes)


@pytest.mark.parametrize("agent", ["hangs_on_odd_targets", "blocks_on_odd_targets"])
def test_hung_agents_fail_at_the_timeout_side_by_side_and_the_others_finish(agent):
    rows = [{"target": t} for t in (1, 2, 3, 4, 5, 6)]
    start = time.monotonic()
    episodes, _ = _play(_task(agent, timeout_s=1.5), rows=rows)
    took = time.monotonic() - start
    hung = [t for t in episodes if t.failed]
    assert len(hung) == 3 and all("timeout_s = 1.5 s" in t.info["error"] for t in hung)
    assert [t.reward for t in episodes if not t.failed] == [0.0, 0.0, 0.0]
    assert took < 2 * 1.5 + 3, took  # three hung episodes cost one timeout, not three


def test_an_agent_past_its_requests_ends_its_episode_as_max_turns_not_as_a_failure():
    (t,), _ = _play(_task("never_stops_asking"), rows=[{"target": 7}])
    assert t.stop_reason is StopReason.MAX_TURNS and not t.failed
    assert t.reward == 0.0 and t.info["requests"] == LIMITS.max_turns
    assert "requests are used up" in t.info["refused"]


def test_an_agent_past_the_context_ends_its_episode_as_max_tokens():
    limits = LoopLimits(max_turns=10, max_new_tokens=8, max_context_tokens=40)
    (t,), _ = _play(_task("never_stops_asking"), rows=[{"target": 7}], limits=limits)
    assert t.stop_reason is StopReason.MAX_TOKENS and not t.failed
    assert len(t.tokens) <= 40


def test_a_session_key_opens_its_own_session_only_and_expires_with_its_episode():
    import openai

    sample_agents.STASH.clear()
    _play(_task("stash_then_answer"))
    first, second = sample_agents.STASH["e0"], sample_agents.STASH["e1"]
    for base_url, key in ((first.base_url, first.api_key), (first.base_url, second.api_key)):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=5)
        with pytest.raises((openai.NotFoundError, openai.APIConnectionError)):
            client.chat.completions.create(model="policy", messages=first.messages())


def test_the_batch_samples_episodes_together():
    rows = [{"target": t} for t in range(8)]
    sampler = RuleSampler()
    calls = []
    inner = sampler.sample
    sampler.sample = lambda prompts, *a, **k: calls.append(len(prompts)) or inner(prompts, *a, **k)
    episodes, _ = _play(_task("answer_once"), rows=rows, sampler=sampler)
    assert [t.reward for t in episodes] == [float(t == 7) for t in range(8)]
    assert sum(calls) == 8 and len(calls) < 8, calls  # requests share sampler calls


def test_sessions_sample_in_lockstep_in_episode_order_whenever_requests_arrive():
    rows = [{"target": t} for t in range(6)]
    sampler = RuleSampler()
    calls = []
    inner = sampler.sample
    sampler.sample = lambda prompts, *a, **k: calls.append(prompts) or inner(prompts, *a, **k)
    episodes, _ = _play(_task("dawdles_between_turns"), rows=rows, sampler=sampler)
    assert [len(c) for c in calls] == [6, 6, 6]  # each turn of every session in one call
    for turn in calls:  # in episode order: each row's prompt names its own target
        assert [ByteChat().decode(p).count(f"(row {t})") for t, p in enumerate(turn)] == [1] * 6
    assert all(t.info["requests"] == 3 and not t.failed for t in episodes)


def test_rollout_messages_are_the_tasks_opening():
    (t,), sampler = _play(_task("answer_once"), rows=[{"target": 7}])
    assert sampler.prompts[0][-1] != END
    assert ByteChat().decode(t.tokens[: t.prompt_len]).count("guess 0-9") == 1


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["env.name=agent:sample_agents:nope"], "has no attribute 'nope'"),
        (["env.name=agent:no_such_module:run"], "cannot import module 'no_such_module'"),
        (["env.name=agent:sample_agents:RuleSampler"], "is not a function"),
        (["env.name=agent:sample_agents:answer_once", "env.params.task=chess"], "chess"),
        (
            [
                "env.name=agent:sample_agents:answer_once",
                "env.params.task=agent:sample_agents:raises",
            ],
            "not another agent",
        ),
        (["env.name=agent:sample_agents:answer_once", "env.params.timeout_s=0"], "timeout_s"),
        (["env.name=agent:sample_agents:answer_once", "env.params.reward=x.y:z"], "reward"),
        (["env.name=agent:sample_agents:answer_once", "env.mode=ray"], "'local' only"),
    ],
)
def test_a_bad_agent_config_fails_before_the_job_naming_the_cause(overrides, named):
    from flowrl.infra.configfile import ConfigError
    from flowrl.tasks.schemas import load_job

    with pytest.raises(ConfigError, match=named):
        load_job(None, overrides)
