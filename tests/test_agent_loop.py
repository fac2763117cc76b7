"""The agent-loop FSM with a byte-level chat format and a scripted sampler (no model)."""

from __future__ import annotations

import pickle

import pytest
from fakes import (
    ASSISTANT,
    END,
    SYSTEM,
    USER,
    ByteChat,
    GuessNumberEnv,
    RaisingEnv,
    ScriptedSampler,
    fake_logprob,
    say,
    text_ids,
)

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.agent_loop.types import StopReason
from flowrl.environments.arithmetic import ArithmeticEnv

CHAT = ByteChat()


def user_prompt(text: str) -> list[int]:
    return CHAT.encode_prompt([{"role": "user", "content": text}])


def observation(text: str) -> list[int]:
    return CHAT.encode_turn({"role": "user", "content": text})


def test_single_turn_batch_tokens_masks_logprobs_and_rewards():
    envs = [ArithmeticEnv(), ArithmeticEnv()]
    rows = [{"question": "12+7=", "answer": "19"}, {"question": "3+4=", "answer": "7"}]
    sampler = ScriptedSampler([[say("19"), say("8")]])
    limits = LoopLimits(temperature=0.7)

    right, wrong = run_episodes(envs, rows, [0, 1], sampler, CHAT, limits, ["a", "b"])

    assert len(sampler.calls) == 1
    call = sampler.calls[0]
    assert call["prompts"] == [user_prompt("12+7="), user_prompt("3+4=")]
    assert (call["max_new_tokens"], call["temperature"]) == (16, 0.7)

    prompt = user_prompt("12+7=")  # [USER] 1 2 + 7 = [END] [ASSISTANT]
    assert prompt == [USER, *text_ids("12+7="), END, ASSISTANT]
    assert right.tokens == prompt + [ord("1"), ord("9"), END]
    assert right.loss_mask == [0] * len(prompt) + [1, 1, 1]
    assert right.logprobs == [0.0] * len(prompt) + [fake_logprob(0, 0, p) for p in range(3)]
    assert right.prompt_len == len(prompt)
    assert (right.episode_id, right.group_id) == ("a", 0)
    assert (wrong.episode_id, wrong.group_id) == ("b", 1)

    assert right.turn_rewards == [1.0] and wrong.turn_rewards == [0.0]
    assert right.stop_reason is wrong.stop_reason is StopReason.DONE
    assert right.info == {"correct": True, "num_turns": 1, "truncated": False}
    assert wrong.info["correct"] is False
    # The outcome reward sits on the last sampled token (the stop token).
    assert right.token_rewards() == [0.0] * (len(right.tokens) - 1) + [1.0]
    assert right.messages == [
        {"role": "user", "content": "12+7="},
        {"role": "assistant", "content": "19"},  # stop token stripped before decoding
    ]
    assert pickle.loads(pickle.dumps(right)) == right


def test_system_prompt_is_rendered_only_when_non_empty():
    rows = [{"question": "1+1=", "answer": "2"}] * 2
    envs = [ArithmeticEnv(system_prompt="calc"), ArithmeticEnv()]
    trajs = run_episodes(
        envs, rows, [0, 0], ScriptedSampler([[say("2"), say("2")]]), CHAT, LoopLimits()
    )

    with_system, without = trajs
    assert with_system.tokens[:6] == [SYSTEM, *text_ids("calc"), END]
    assert with_system.messages[0] == {"role": "system", "content": "calc"}
    assert without.tokens[0] == USER and without.messages[0]["role"] == "user"


def test_multi_turn_tokens_are_the_exact_concatenation_of_pieces():
    env = GuessNumberEnv()
    sampler = ScriptedSampler([[say("3")], [say("9")], [say("7")]])

    (traj,) = run_episodes([env], [{"target": 7}], [0], sampler, CHAT, LoopLimits(max_turns=5))

    pieces = [
        (user_prompt("guess 0-9"), 0),
        (say("3"), 1),
        (observation("higher"), 0),
        (say("9"), 1),
        (observation("lower"), 0),
        (say("7"), 1),
    ]
    assert traj.tokens == [t for piece, _ in pieces for t in piece]
    assert traj.loss_mask == [mask for piece, mask in pieces for _ in piece]
    # Sampled log-probs are the sampler's, in order; injected tokens carry 0.0.
    expected_logprobs = []
    call = 0
    for piece, mask in pieces:
        expected_logprobs += [fake_logprob(call, 0, p) if mask else 0.0 for p in range(len(piece))]
        call += mask
    assert traj.logprobs == expected_logprobs
    # Rendering the conversation at once gives the same tokens: nothing was re-encoded.
    assert traj.tokens == CHAT.render(traj.messages)
    assert env.actions == ["3", "9", "7"]  # each turn decoded on its own, stop token stripped
    assert traj.turn_rewards == [0.0, 0.0, 1.0] and traj.reward == 1.0
    assert traj.stop_reason is StopReason.DONE
    assert traj.info == {"guesses": 3, "correct": True, "num_turns": 3, "truncated": False}
    # Every call's prompt is exactly the trajectory so far.
    for c in sampler.calls:
        assert traj.tokens[: len(c["prompts"][0])] == c["prompts"][0]
    rewards = traj.token_rewards()
    assert rewards[-1] == 1.0 and sum(rewards) == 1.0


def test_one_sampler_call_per_round_for_the_generating_episodes():
    envs = [GuessNumberEnv(), GuessNumberEnv(), GuessNumberEnv()]
    rows = [{"target": 1}, {"target": 5}, {"target": 2}]
    sampler = ScriptedSampler(
        [
            [say("1"), say("4"), say("0")],  # round 1: episode 0 is right
            [say("6"), say("2")],  # round 2: episode 2 is right
            [say("5")],  # round 3: episode 1 is right
        ]
    )

    trajs = run_episodes(envs, rows, [0, 1, 2], sampler, CHAT, LoopLimits(max_turns=4))

    assert [len(c["prompts"]) for c in sampler.calls] == [3, 2, 1]
    assert sampler.calls[1]["prompts"][1][-1] == ASSISTANT
    assert [t.info["num_turns"] for t in trajs] == [1, 3, 2]
    assert [t.turn_rewards for t in trajs] == [[1.0], [0.0, 0.0, 1.0], [0.0, 1.0]]
    assert all(t.stop_reason is StopReason.DONE for t in trajs)


def test_max_turns_ends_without_injecting_the_last_observation():
    sampler = ScriptedSampler([[say("3")], [say("4")]])

    (traj,) = run_episodes(
        [GuessNumberEnv()], [{"target": 7}], [0], sampler, CHAT, LoopLimits(max_turns=2)
    )

    assert traj.stop_reason is StopReason.MAX_TURNS
    assert traj.turn_rewards == [0.0, 0.0]
    assert traj.tokens[-2:] == say("4") and traj.loss_mask[-2:] == [1, 1]
    assert traj.messages[-1] == {"role": "assistant", "content": "4"}


def test_turn_cut_by_the_context_is_stepped_then_ends_max_tokens():
    prompt = user_prompt("guess 0-9")
    env = GuessNumberEnv()
    sampler = ScriptedSampler([[say("12345")]])
    limits = LoopLimits(max_turns=3, max_new_tokens=16, max_context_tokens=len(prompt) + 4)

    (traj,) = run_episodes([env], [{"target": 7}], [0], sampler, CHAT, limits)

    assert sampler.calls[0]["max_new_tokens"] == 4  # capped by the remaining context
    assert traj.tokens == prompt + text_ids("1234")
    assert len(traj.tokens) == limits.max_context_tokens
    assert env.actions == ["1234"]  # the env is stepped with what was produced
    assert traj.turn_rewards == [0.0]
    assert traj.stop_reason is StopReason.MAX_TOKENS
    assert traj.info["truncated"] is True


def test_single_turn_cut_short_is_still_done_and_marked_truncated():
    sampler = ScriptedSampler([[say("1999")]])
    limits = LoopLimits(max_new_tokens=2)

    (traj,) = run_episodes(
        [ArithmeticEnv()], [{"question": "1+1=", "answer": "2"}], [0], sampler, CHAT, limits
    )

    assert traj.tokens[traj.prompt_len :] == text_ids("19")
    assert traj.stop_reason is StopReason.DONE
    assert traj.info == {"correct": False, "num_turns": 1, "truncated": True}


@pytest.mark.parametrize("penalty", [0.0, -0.5])
def test_a_turn_the_policy_did_not_end_is_charged_the_unfinished_turn_reward(penalty):
    # "7" then the stop token fits the 2-token budget; "19" is right but cut before its stop.
    rows = [{"question": "3+4=", "answer": "7"}, {"question": "12+7=", "answer": "19"}]
    sampler = ScriptedSampler([[say("7"), say("19")]])
    limits = LoopLimits(max_new_tokens=2, unfinished_turn_reward=penalty)

    ended, cut = run_episodes(
        [ArithmeticEnv(), ArithmeticEnv()], rows, [0, 1], sampler, CHAT, limits
    )

    assert ended.info["truncated"] is False and cut.info["truncated"] is True
    assert ended.turn_rewards == [1.0]  # an ended turn pays nothing
    assert cut.info["correct"] is True  # the cut text is still the action ...
    assert cut.turn_rewards == [1.0 + penalty]  # ... and is charged for not ending


def test_an_unfinished_turn_reward_above_zero_is_refused():
    with pytest.raises(ValueError, match="unfinished_turn_reward must be <= 0"):
        LoopLimits(unfinished_turn_reward=0.5)


@pytest.mark.parametrize(("spare", "expected"), [(0, StopReason.MAX_TOKENS), (1, StopReason.DONE)])
def test_observation_is_injected_only_if_a_reply_still_fits(spare, expected):
    prompt, first = user_prompt("guess 0-9"), say("3")
    budget = len(prompt) + len(first) + len(observation("higher")) + spare
    sampler = ScriptedSampler([[first], [say("7")]])
    limits = LoopLimits(max_turns=3, max_context_tokens=budget)

    (traj,) = run_episodes([GuessNumberEnv()], [{"target": 7}], [0], sampler, CHAT, limits)

    assert traj.stop_reason is expected
    if expected is StopReason.MAX_TOKENS:
        assert traj.tokens == prompt + first  # the observation was not appended
        assert len(sampler.calls) == 1
    else:
        assert traj.tokens == prompt + first + observation("higher") + [ord("7")]
        assert sampler.calls[1]["max_new_tokens"] == 1


def test_prompt_that_fills_the_context_ends_before_sampling():
    limits = LoopLimits(max_context_tokens=len(user_prompt("guess 0-9")))
    sampler = ScriptedSampler([])

    (traj,) = run_episodes([GuessNumberEnv()], [{"target": 7}], [0], sampler, CHAT, limits)

    assert traj.stop_reason is StopReason.MAX_TOKENS
    assert sampler.calls == [] and traj.num_sampled_tokens == 0 and traj.turn_rewards == []


def test_each_episode_keeps_its_own_budget_in_a_shared_call():
    short, long = {"question": "1+1=", "answer": "2"}, {"question": "10+10=", "answer": "20"}
    limits = LoopLimits(max_new_tokens=8, max_context_tokens=len(user_prompt("10+10=")) + 3)
    sampler = ScriptedSampler([[say("2222"), say("2000")]])

    a, b = run_episodes(
        [ArithmeticEnv(), ArithmeticEnv()], [short, long], [0, 1], sampler, CHAT, limits
    )

    assert sampler.calls[0]["max_new_tokens"] == 5  # the largest remaining budget
    assert a.tokens[a.prompt_len :] == text_ids("2222") + [END]
    assert b.tokens[b.prompt_len :] == text_ids("200")
    assert len(b.tokens) == limits.max_context_tokens


def test_truncated_turn_is_closed_with_a_stop_token_before_the_observation():
    sampler = ScriptedSampler([[say("123")], [say("7")]])
    limits = LoopLimits(max_turns=2, max_new_tokens=2)

    (traj,) = run_episodes([GuessNumberEnv()], [{"target": 7}], [0], sampler, CHAT, limits)

    prompt = user_prompt("guess 0-9")
    assert traj.tokens == prompt + text_ids("12") + [END] + observation("lower") + say("7")
    injected = [END] + observation("lower")  # the closing stop token is injected, not sampled
    assert traj.loss_mask == [0] * len(prompt) + [1, 1] + [0] * len(injected) + [1, 1]
    assert traj.stop_reason is StopReason.DONE


def test_env_errors_end_only_their_own_episode():
    envs = [RaisingEnv("reset"), RaisingEnv("step"), GuessNumberEnv()]
    rows = [{"target": 1}, {"target": 2}, {"target": 3}]
    sampler = ScriptedSampler([[say("2"), say("0")], [say("3")]])

    bad_reset, bad_step, ok = run_episodes(
        envs, rows, [0, 1, 2], sampler, CHAT, LoopLimits(max_turns=3)
    )

    assert [len(c["prompts"]) for c in sampler.calls] == [2, 1]
    assert bad_reset.stop_reason is StopReason.ERROR and bad_reset.failed
    assert bad_reset.info["error"] == repr(KeyError("no such puzzle"))
    assert bad_reset.tokens == [] and bad_reset.turn_rewards == []
    assert bad_step.stop_reason is StopReason.ERROR
    assert bad_step.info["error"] == repr(ZeroDivisionError("env bug"))
    assert bad_step.tokens[bad_step.prompt_len :] == say("2")  # what was sampled stays
    assert bad_step.turn_rewards == []
    assert ok.stop_reason is StopReason.DONE and ok.turn_rewards == [0.0, 1.0]


def test_mismatched_inputs_and_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="differ in length"):
        run_episodes([GuessNumberEnv()], [], [0], ScriptedSampler([]), CHAT, LoopLimits())
    with pytest.raises(ValueError, match="max_turns"):
        LoopLimits(max_turns=0)


TOOL = 260
"""Role id of tool messages in ``ToolByteChat``."""


class ToolByteChat(ByteChat):
    """ByteChat that also renders ``tool`` messages (``[TOOL] bytes [END]``)."""

    def encode_message(self, message: dict[str, str]) -> list[int]:
        if message["role"] == "tool":
            return [TOOL, *text_ids(message["content"]), END]
        return super().encode_message(message)


class EchoToolEnv(GuessNumberEnv):
    """Answers a guess with a tool message (``observation_role``), or with ``role`` if given."""

    def __init__(self, role: str = "tool") -> None:
        super().__init__()
        self.role = role

    def step(self, action):
        result = super().step(action)
        info = {**result.info, "observation_role": self.role}
        return type(result)(result.observation, result.reward, result.done, info)


def test_environment_chooses_the_tool_role_for_its_observation():
    chat = ToolByteChat()
    sampler = ScriptedSampler([[say("3")], [say("7")]])

    (traj,) = run_episodes([EchoToolEnv()], [{"target": 7}], [0], sampler, chat, LoopLimits(3))

    tool_turn = chat.encode_turn({"role": "tool", "content": "higher"})
    assert tool_turn[0] == TOOL
    prompt = chat.encode_prompt([{"role": "user", "content": "guess 0-9"}])
    assert traj.tokens == prompt + say("3") + tool_turn + say("7")
    assert traj.loss_mask == [0] * len(prompt) + [1, 1] + [0] * len(tool_turn) + [1, 1]
    assert traj.messages[2] == {"role": "tool", "content": "higher"}
    assert traj.tokens == chat.render(traj.messages)
    assert "observation_role" not in traj.info  # consumed by the loop, not a metric
    assert traj.stop_reason is StopReason.DONE


def test_unknown_observation_role_fails_only_that_episode():
    sampler = ScriptedSampler([[say("3"), say("3")], [say("7")]])
    bad, ok = run_episodes(
        [EchoToolEnv(role="system"), GuessNumberEnv()],
        [{"target": 7}, {"target": 7}],
        [0, 1],
        sampler,
        CHAT,
        LoopLimits(max_turns=3),
    )
    assert bad.stop_reason is StopReason.ERROR and "observation_role" in bad.info["error"]
    assert ok.stop_reason is StopReason.DONE
