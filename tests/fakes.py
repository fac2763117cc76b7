"""Fakes for agent-loop and environment tests: a byte-level chat format, a scripted sampler and
small environments. No model, no tokenizer, no network.
"""

from __future__ import annotations

from typing import Any

from flowrl.agent_loop.types import SampleResult
from flowrl.environments.types import StepResult

SYSTEM, USER, ASSISTANT, END, IMAGE = 256, 257, 258, 259, 260
"""Special ids of ``ByteChat``: role markers, the end-of-message (stop) token, an image token."""
IMAGE_TOKENS = 3
"""``ByteChat`` renders an image part as this many ``IMAGE`` tokens."""
_ROLE_IDS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
_SPECIAL_NAMES = {
    SYSTEM: "system",
    USER: "user",
    ASSISTANT: "assistant",
    END: "end",
    IMAGE: "image",
}


def text_ids(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` as token ids."""
    return list(text.encode("utf-8"))


def say(text: str, stop: bool = True) -> list[int]:
    """What a policy samples to answer ``text``: its bytes, then the stop token if ``stop``."""
    return text_ids(text) + ([END] if stop else [])


class ByteChat:
    """A ChatFormat where each byte is a token and each message is ``[ROLE] bytes [END]``.

    ``encode_prompt`` / ``encode_turn`` end with ``[ASSISTANT]`` (the generation prompt), so a
    conversation whose assistant turns end with END renders as the concatenation of the pieces.
    Content given as parts renders an image part as ``IMAGE_TOKENS`` copies of ``IMAGE``.
    """

    stop_token_ids = [END]

    def encode_message(self, message: dict[str, Any]) -> list[int]:
        content = message["content"]
        if isinstance(content, str):
            body = text_ids(content)
        else:
            body = []
            for part in content:
                image = part["type"] == "image"
                body += [IMAGE] * IMAGE_TOKENS if image else text_ids(part["text"])
        return [_ROLE_IDS[message["role"]], *body, END]

    def encode_prompt(self, messages: list[dict[str, str]], tools: Any = None) -> list[int]:
        assert not tools, "ByteChat has no tool syntax"
        return [t for m in messages for t in self.encode_message(m)] + [ASSISTANT]

    def encode_turn(self, message: dict[str, str]) -> list[int]:
        return self.encode_turns([message])

    def encode_turns(self, messages: list[dict[str, str]], tools: Any = None) -> list[int]:
        """Several messages after a sampled turn, one generation prompt after the last (as
        ``HFChatFormat.encode_turns``; the rollout sessions use it)."""
        assert not tools, "ByteChat has no tool syntax"
        return [t for m in messages for t in self.encode_message(m)] + [ASSISTANT]

    def closing(self, sampled: list[int]) -> list[int]:
        return [] if sampled[-1:] == [END] else [END]

    def response(self, text: str) -> str:
        return text

    def encode_reply(self, content: str) -> list[int]:
        return text_ids(content) + [END]

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The whole conversation at once (assistant messages carry their own role marker)."""
        return [t for m in messages for t in self.encode_message(m)]

    def decode(self, tokens: list[int]) -> str:
        parts, buffer = [], bytearray()
        for t in tokens:
            if t < 256:
                buffer.append(t)
                continue
            parts.append(buffer.decode("utf-8", errors="replace"))
            parts.append(f"<|{_SPECIAL_NAMES[t]}|>")
            buffer = bytearray()
        parts.append(buffer.decode("utf-8", errors="replace"))
        return "".join(parts)


def fake_logprob(call: int, row: int, position: int) -> float:
    """A distinct log-prob for every (call, row, position), so misalignment shows up in tests."""
    return -round(0.001 * (1000 * call + 100 * row + position + 1), 6)


class ScriptedSampler:
    """Returns predetermined completions and records every call.

    ``rounds[c][r]`` is the completion (token ids) for prompt ``r`` of call ``c``. Like a real
    sampler, a completion is cut at ``max_new_tokens`` (``finish_reason="length"``). The images
    of each call (``None`` when the loop passed none) are recorded too.
    """

    def __init__(self, rounds: list[list[list[int]]]) -> None:
        self.rounds = rounds
        self.calls: list[dict[str, Any]] = []

    def sample(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        images: list[list[bytes]] | None = None,
    ) -> list[SampleResult]:
        call = len(self.calls)
        script = self.rounds[call]
        assert len(script) == len(prompts), f"call {call}: {len(prompts)} prompts, script {script}"
        results = []
        for row, completion in enumerate(script):
            tokens = completion[:max_new_tokens]
            finish = "stop" if tokens and tokens[-1] == END else "length"
            logprobs = [fake_logprob(call, row, p) for p in range(len(tokens))]
            results.append(SampleResult(tokens=tokens, logprobs=logprobs, finish_reason=finish))
        self.calls.append(
            {
                "prompts": [list(p) for p in prompts],
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "images": images,
                "results": results,
            }
        )
        return results


class GuessNumberEnv:
    """Multi-turn: guess a number; the env answers "higher" / "lower" until the guess is right."""

    def __init__(self, system_prompt: str = "") -> None:
        self.system_prompt = system_prompt
        self.target: int | None = None
        self.actions: list[str] = []

    def reset(self, target: int, **_: Any) -> str:
        self.target, self.actions = target, []
        return "guess 0-9"

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        try:
            guess = int(action.strip())
        except ValueError:
            return StepResult("a number", 0.0, False, {"guesses": len(self.actions)})
        if guess == self.target:
            return StepResult("", 1.0, True, {"guesses": len(self.actions), "correct": True})
        hint = "higher" if guess < self.target else "lower"
        return StepResult(hint, 0.0, False, {"guesses": len(self.actions)})

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_initial_user_message(self) -> str:
        return "guess 0-9"


class RaisingEnv(GuessNumberEnv):
    """A GuessNumberEnv that raises in ``reset`` or ``step`` (``fail_in`` names which)."""

    def __init__(self, fail_in: str) -> None:
        super().__init__()
        self.fail_in = fail_in

    def reset(self, target: int, **kwargs: Any) -> str:
        if self.fail_in == "reset":
            raise KeyError("no such puzzle")
        return super().reset(target, **kwargs)

    def step(self, action: str) -> StepResult:
        if self.fail_in == "step":
            raise ZeroDivisionError("env bug")
        return super().step(action)
