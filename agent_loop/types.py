"""Data contracts of the agent loop: what the sampler returns and what a rollout produces.

Token-level invariants (pinned by tests):
- ``tokens`` is exactly the sequence that was sampled and injected, never re-encoded;
- ``loss_mask[i] == 1`` iff ``tokens[i]`` was sampled by the policy;
- ``logprobs[i]`` is the sampler's log-probability of ``tokens[i]`` (0.0 where the mask is 0);
- the outcome reward sits on the last token whose mask is 1 (see ``Trajectory.token_rewards``);
- images (vision-language policies): each image shown is in ``images``, in order, and its
  image tokens are injected tokens (mask 0) at the place the chat format expanded them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class StopReason(StrEnum):
    """Why an episode ended."""

    DONE = "done"
    """The environment said the episode is over."""
    MAX_TURNS = "max_turns"
    """The policy used all its turns."""
    MAX_TOKENS = "max_tokens"
    """The context (prompt + all turns) reached its token budget."""
    ERROR = "error"
    """The environment raised; the episode is excluded from the update."""


class FSMState(StrEnum):
    """States of one episode in the agent loop."""

    PENDING = "pending"
    GENERATING = "generating"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass(frozen=True)
class SampleResult:
    """One completion from the sampler."""

    tokens: list[int]
    """Sampled token ids, including the stop token when one was produced."""
    logprobs: list[float]
    """Log-probability of each sampled token under the sampling distribution."""
    finish_reason: str
    """``"stop"`` (a stop token was sampled) or ``"length"`` (``max_new_tokens`` reached)."""


class Sampler(Protocol):
    """Generates completions for a batch of token-id prompts (actor handles are adapted to it).

    ``images`` is passed only when some prompt shows images: ``images[i]`` are the encoded
    images (PNG/JPEG bytes) whose image tokens ``prompts[i]`` holds, in order.
    """

    def sample(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        images: list[list[bytes]] | None = None,
    ) -> list[SampleResult]: ...


class ChatFormat(Protocol):
    """Turns chat messages into token ids, one message at a time, so nothing is re-encoded.

    ``encode_prompt(messages)`` renders the opening messages plus the generation prompt.
    A sampled turn is followed by ``closing(sampled)`` (the end-of-turn token when the turn did
    not end with it) and ``encode_turn(message)``: the template's separator after the end of
    turn, one more (user or tool) message and the generation prompt. Concatenating the pieces
    equals rendering the whole conversation at once. ``stop_token_ids[0]`` is the template's
    end-of-turn token; sampling stops on any of them. ``response(decode(sampled))`` is what the
    environment sees (a thinking model's ``<think>`` block removed). A message's content is
    text, or (images) a list of parts ``{"type": "image"}`` and ``{"type": "text", ...}``, each
    image part rendered as its image tokens.
    """

    stop_token_ids: list[int]

    def encode_prompt(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def encode_turn(self, message: dict[str, Any]) -> list[int]: ...

    def closing(self, sampled: list[int]) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...

    def response(self, text: str) -> str: ...


@dataclass
class Trajectory:
    """One episode as tokens, ready for training. Picklable and small."""

    episode_id: str
    group_id: int
    """Episodes started from the same data row share a group (for group-relative advantages)."""
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    """Number of tokens before the first sampled token."""
    turn_rewards: list[float] = field(default_factory=list)
    """Reward of each policy turn, in order."""
    stop_reason: StopReason | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as text, for logs and sample artifacts only (never trained on); an image
    appears as a part ``{"type": "image"}`` (its bytes are in ``images``)."""
    images: list[bytes] = field(default_factory=list)
    """Encoded images (PNG/JPEG) shown to the policy, in the order of their tokens in ``tokens``."""
    info: dict[str, Any] = field(default_factory=dict)
    """The last ``StepResult.info`` plus loop diagnostics (e.g. ``{"correct": True}``)."""

    @property
    def reward(self) -> float:
        """Episode return: the sum of the turn rewards."""
        return float(sum(self.turn_rewards))

    @property
    def failed(self) -> bool:
        return self.stop_reason is StopReason.ERROR

    @property
    def num_sampled_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def token_rewards(self) -> list[float]:
        """Per-token rewards: the episode return on the last sampled token, 0 elsewhere."""
        rewards = [0.0] * len(self.tokens)
        trainable = [i for i, m in enumerate(self.loss_mask) if m]
        if trainable:
            rewards[trainable[-1]] = self.reward
        return rewards
