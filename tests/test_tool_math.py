"""Math with a calculator tool: the protocol (call → tool message → final answer), malformed
calls, rewards, info fields, the task config, and a scripted episode through the agent loop."""

from __future__ import annotations

import pytest
from fakes import END, ByteChat, ScriptedSampler, say, text_ids
from pydantic import ValidationError

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.agent_loop.types import StopReason
from flowrl.environments.registry import make_task
from flowrl.environments.tool_math import (
    DEFAULT_SYSTEM_PROMPT,
    ToolMathEnv,
    ToolMathTask,
    parse_tool_call,
    tool_call_text,
    tool_latency_s,
)

ROW = {"question": "47*86=", "answer": "4042", "expr": "47*86"}
INFO_KEYS = {"correct", "tool_calls", "tool_errors", "used_tool", "correct_tool_use"}


def fresh_env(**kwargs) -> ToolMathEnv:
    env = ToolMathEnv(**kwargs)
    assert env.reset(**ROW) == "47*86="
    return env


def test_call_then_tool_message_then_correct_answer():
    env = fresh_env()

    call = env.step('<tool_call>{"expr": "47*86"}</tool_call>')
    assert (call.observation, call.reward, call.done) == ("4042", 0.0, False)
    assert call.info["observation_role"] == "tool"
    assert set(call.info) == INFO_KEYS | {"observation_role"}

    final = env.step(" 4042 ")
    assert (final.reward, final.done) == (1.0, True)
    assert final.info == {
        "correct": True,
        "tool_calls": 1,
        "tool_errors": 0,
        "used_tool": True,
        "correct_tool_use": True,
    }
    assert "observation_role" not in final.info


def test_answer_without_the_tool_is_scored_but_not_tool_use():
    env = fresh_env()
    result = env.step("4042")
    assert result.done and result.reward == 1.0
    assert result.info["used_tool"] is False and result.info["correct_tool_use"] is False


def test_correct_tool_use_means_the_answer_is_a_tool_result():
    env = fresh_env()
    env.step(tool_call_text("47*68"))  # a well-formed call of the wrong expression
    result = env.step("4042")
    assert result.reward == 1.0 and result.info["correct"] is True  # right by itself
    assert result.info["correct_tool_use"] is False  # but not the tool's result
    env = fresh_env()
    env.step(tool_call_text("47*86"))
    result = env.step("4043")
    assert result.reward == 0.0 and result.info["correct"] is False
    assert result.info["correct_tool_use"] is False


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ("<tool_call>{bad json}</tool_call>", "bad JSON"),
        ('<tool_call>{"x": "1+1"}</tool_call>', 'missing "expr"'),
        ('<tool_call>{"expr": 3}</tool_call>', "must be a string"),
        ('<tool_call>["1+1"]</tool_call>', "bad call"),
        ('<tool_call>{"name": "python", "expr": "1"}</tool_call>', "unknown tool"),
        ('<tool_call>{"expr": "1+1"}', "malformed call"),
        ('{"expr": "1+1"}</tool_call>', "malformed call"),
        (tool_call_text("1") + tool_call_text("2"), "one tool call per turn"),
        (tool_call_text("os.system('ls')"), "not allowed"),
        (tool_call_text("1/0"), "division by zero"),
    ],
)
def test_malformed_calls_get_an_error_observation_never_a_crash(action, message):
    env = fresh_env()
    result = env.step(action)
    assert result.observation.startswith("error: ") and message in result.observation
    assert (result.reward, result.done) == (0.0, False)
    assert result.info["observation_role"] == "tool"
    assert result.info["tool_calls"] == 1 and result.info["tool_errors"] == 1
    final = env.step("4042")
    assert final.info["correct"] is True and final.info["tool_errors"] == 1


def test_openai_style_call_is_accepted():
    action = '<tool_call>{"name": "calculator", "arguments": {"expr": "2*3"}}</tool_call>'
    assert parse_tool_call(action) == "2*3"
    assert parse_tool_call("42") is None


def test_calls_beyond_the_limit_are_refused():
    env = fresh_env(max_tool_calls=1)
    assert env.step(tool_call_text("47*86")).observation == "4042"
    second = env.step(tool_call_text("47*86"))
    assert "at most 1 calls" in second.observation and second.info["tool_errors"] == 1
    assert env.step("4042").info["correct_tool_use"] is True


def test_format_reward_needs_clean_calls_and_an_integer_answer():
    env = fresh_env(format_reward=0.1)
    env.step(tool_call_text("47*86"))
    assert env.step("4042").reward == pytest.approx(1.1)
    env = fresh_env(format_reward=0.1)
    assert env.step("4043").reward == pytest.approx(0.1)  # wrong, but well-formed
    env = fresh_env(format_reward=0.1)
    env.step("<tool_call>nope</tool_call>")
    assert env.step("4042").reward == pytest.approx(1.0)
    env = fresh_env(format_reward=0.1)
    assert env.step("about 4000").reward == 0.0


def test_step_after_the_end_raises():
    env = fresh_env()
    env.step("1")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("1")


# --- task config ---------------------------------------------------------------------------


def test_task_problems_eval_set_and_sft_example():
    task = ToolMathTask(forms=["a*b", "a+b*c"], eval_size=50)
    eval_set = task.eval_set()
    assert len({r["question"] for r in eval_set}) == 50 and eval_set == task.eval_set()
    held_out = {r["question"] for r in eval_set}
    train = task.train_source().next_batch(300)
    assert not held_out & {r["question"] for r in train}
    assert train[:3] == ToolMathTask(
        forms=["a*b", "a+b*c"], eval_size=50
    ).train_source().next_batch(3)
    for row in train[:50]:
        expr = row["question"].rstrip("=")
        assert row["expr"] == expr and str(eval(expr)) == row["answer"]  # trusted test input
        a, *_ = expr.replace("+", "*").split("*")
        assert 10 <= int(a) <= 99
    assert {"*" in r["expr"] and "+" in r["expr"] for r in train} == {True, False}

    messages = task.sft_example(ROW)
    assert messages == [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": "47*86="},
        {"role": "assistant", "content": '<tool_call>{"expr": "47*86"}</tool_call>'},
        {"role": "tool", "content": "4042"},
        {"role": "assistant", "content": "4042"},
    ]
    # Replaying the demonstration through the env gives the same tool message and full reward.
    env = task.make_env()
    env.reset(**ROW)
    assert env.step(messages[2]["content"]).observation == messages[3]["content"]
    assert env.step(messages[4]["content"]).info["correct_tool_use"] is True


def test_task_config_is_validated_with_the_field_named():
    with pytest.raises(ValidationError, match="extra"):
        ToolMathTask(nonsense=1)
    with pytest.raises(ValidationError, match="min_operand"):
        ToolMathTask(min_operand=50, max_operand=10)
    with pytest.raises(ValidationError, match="forms"):
        ToolMathTask(forms=["a/b"])
    with pytest.raises(ValidationError, match="distinct"):
        ToolMathTask(min_operand=1, max_operand=2, eval_size=10)
    assert isinstance(make_task("tool_math", {"eval_size": 5}), ToolMathTask)
    assert "Tool" in DEFAULT_SYSTEM_PROMPT and "<tool_call>" in DEFAULT_SYSTEM_PROMPT


def test_tool_latency_is_heavy_tailed_and_the_same_for_the_same_call():
    """Issue 43's long-tailed tool: log-normal waits with the configured median and p99, drawn
    from (question, call) alone."""
    import statistics

    waits = sorted(tool_latency_s(f"{i}*7=", 1, 0.05, 2.0) for i in range(20_000))
    assert statistics.median(waits) == pytest.approx(0.05, rel=0.05)
    assert waits[int(0.99 * len(waits))] == pytest.approx(2.0, rel=0.15)
    assert tool_latency_s("47*86=", 1, 0.05, 2.0) == tool_latency_s("47*86=", 1, 0.05, 2.0)
    assert tool_latency_s("47*86=", 1, 0.05, 2.0) != tool_latency_s("47*86=", 2, 0.05, 2.0)
    assert tool_latency_s("47*86=", 1, 0.0, 0.0) == 0.0
    with pytest.raises(ValidationError, match="tool_latency_p99_s"):
        ToolMathTask(tool_latency_median_s=0.5, tool_latency_p99_s=0.1)


def test_a_slow_tool_waits_before_answering():
    import time

    env = fresh_env(tool_latency=(0.2, 0.2))  # sigma 0: every call waits 0.2 s
    began = time.perf_counter()
    result = env.step(tool_call_text("47*86"))
    assert time.perf_counter() - began >= 0.2 and result.observation == "4042"


# --- through the agent loop ------------------------------------------------------------------

TOOL = 260


class ToolByteChat(ByteChat):
    def encode_message(self, message: dict[str, str]) -> list[int]:
        if message["role"] == "tool":
            return [TOOL, *text_ids(message["content"]), END]
        return super().encode_message(message)


def test_scripted_episodes_through_the_agent_loop():
    chat = ToolByteChat()
    task = ToolMathTask(eval_size=5, system_prompt="")
    rows = [ROW, ROW]
    sampler = ScriptedSampler(
        [
            [say(tool_call_text("47*86")), say("<tool_call>{oops")],
            [say("4042"), say("4042")],
        ]
    )

    good, sloppy = run_episodes(
        [task.make_env(), task.make_env()], rows, [0, 0], sampler, chat, LoopLimits(3, 64, 256)
    )

    assert [m["role"] for m in good.messages] == ["user", "assistant", "tool", "assistant"]
    assert good.messages[2]["content"] == "4042"
    assert good.tokens == chat.render(good.messages)
    assert good.reward == 1.0 and good.stop_reason is StopReason.DONE
    assert good.info["correct_tool_use"] is True and good.info["tool_calls"] == 1
    assert sloppy.messages[2]["role"] == "tool"
    assert sloppy.messages[2]["content"].startswith("error: malformed call")
    assert sloppy.info["tool_errors"] == 1 and sloppy.info["correct_tool_use"] is False
    assert sloppy.info["correct"] is True
