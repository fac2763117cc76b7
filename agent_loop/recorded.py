"""Training trajectories from an agent's recorded requests (agents that call an endpoint,
``backends.services.openai_api.sessions``), never from text the agent sends back.

Each request of a rollout session is recorded as a ``Turn``: the prompt's token ids as the
endpoint rendered them, and the completion's token ids and log-probs as they were sampled.
``trajectories_from_turns`` strings them together:

- a turn whose prompt starts with the previous turn's prompt + completion, token for token,
  continues the same trajectory: the prompt's new tokens (the chat template's end of the
  assistant turn, the next user or tool message, the generation prompt) are appended with mask
  0 and log-prob 0, then the completion with mask 1 and its sampled log-probs;
- a turn whose prompt does not (the agent rewrote its history: a summary, a dropped or edited
  message) starts a new trajectory, whose prompt is that turn's prompt.

Weighting: every trajectory of an episode carries the episode's whole reward (on its last
sampled token, as ``Trajectory.token_rewards``) and its group id, and is one sample of the
update; so a split episode counts once per piece, and an agent that rewrites its history
contributes each piece's tokens with the episode's outcome (as rLLM and verifiers do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.agent_loop.types import StopReason, Trajectory


@dataclass(frozen=True)
class Turn:
    """One recorded request: what the policy was shown and what it sampled."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The request's messages and the answer, as text (logs and samples only)."""


def trajectories_from_turns(
    turns: list[Turn],
    episode_id: str,
    group_id: int,
    reward: float,
    stop_reason: StopReason = StopReason.DONE,
    info: dict[str, Any] | None = None,
) -> list[Trajectory]:
    """The episode's trajectories (one unless the agent rewrote its history), each with the
    episode's ``reward`` on its last turn. No turn at all: one empty trajectory, which trains
    nothing and still reports the reward."""
    pieces: list[Trajectory] = []
    current: Trajectory | None = None
    for turn in turns:
        if len(turn.logprobs) != len(turn.completion):
            raise ValueError("a turn's log-probs and completion differ in length")
        if current is not None and _extends(turn.prompt, current.tokens):
            new = turn.prompt[len(current.tokens) :]
            current.tokens += new
            current.loss_mask += [0] * len(new)
            current.logprobs += [0.0] * len(new)
        else:
            suffix = f"-{len(pieces)}" if pieces else ""
            current = Trajectory(f"{episode_id}{suffix}", group_id)
            current.tokens = list(turn.prompt)
            current.loss_mask = [0] * len(turn.prompt)
            current.logprobs = [0.0] * len(turn.prompt)
            current.prompt_len = len(turn.prompt)
            pieces.append(current)
        current.tokens += turn.completion
        current.loss_mask += [1] * len(turn.completion)
        current.logprobs += list(turn.logprobs)
        current.turn_rewards.append(0.0)
        current.messages = list(turn.messages)
    if not pieces:
        pieces.append(Trajectory(episode_id, group_id))
    for piece in pieces:
        if piece.turn_rewards:
            piece.turn_rewards[-1] = float(reward)
        else:
            piece.turn_rewards = [float(reward)]
        piece.stop_reason = stop_reason
        piece.info = dict(info or {}) | {"pieces": len(pieces)}
    return pieces


def _extends(prompt: list[int], so_far: list[int]) -> bool:
    return len(prompt) >= len(so_far) and prompt[: len(so_far)] == so_far
