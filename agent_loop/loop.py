"""The agent loop: a finite-state machine over token ids, run for a batch of episodes at once.

Each episode goes ``PENDING → GENERATING ⇄ INTERACTING → TERMINATED``:

- PENDING: ``env.reset(**row)``; the system prompt (when non-empty) and the first user message
  are rendered with ``chat.encode_prompt``. Tokens get mask 0 and log-prob 0.
- GENERATING: all generating episodes are sampled in ONE ``sampler.sample`` call per round.
  Sampled tokens get mask 1 and the sampler's log-probs. Only this turn's tokens are decoded
  (a trailing stop token stripped) and passed to ``env.step``; the turn reward is recorded.
- INTERACTING: the observation is rendered with ``chat.encode_turn`` and appended with mask 0,
  as a message of role ``StepResult.info["observation_role"]`` (``"user"`` when absent; an
  environment answering a tool call sets ``"tool"``). The key is consumed by the loop: it is
  not copied into ``Trajectory.info``. Any other role ends the episode with ERROR.

Nothing is ever decoded and re-encoded: the token sequence is exactly what was produced.

Images: an environment that implements ``get_images()`` (``environments.types.ShowsImages``)
shows them with the observation just rendered (the first user message, or a later observation):
the message's content becomes parts (one ``{"type": "image"}`` per image, then the text), the
chat format renders each image as its image tokens (mask 0), the bytes go to
``Trajectory.images`` in order, and every sampler call gets each prompt's images
(``images=``, only when some prompt has one).

Context budget rule (``max_context_tokens`` counts prompt + all turns):
- a turn samples at most ``min(max_new_tokens, max_context_tokens - len(tokens))`` tokens;
- the env is ALWAYS stepped with whatever the turn produced, even when the turn was cut short,
  so every policy turn has a reward; the episode then ends with, in order of precedence,
  DONE (the env said so), MAX_TURNS (all turns used), or MAX_TOKENS (the next observation
  would leave no room for even one more sampled token; it is then not appended);
- a prompt that already fills the budget ends as MAX_TOKENS before any sampling.
When a turn ends without a stop token and the episode goes on, the first stop token is appended
(mask 0) to close the assistant message before the observation, as a rendered chat would.

An exception from ``env.reset`` or ``env.step`` ends only that episode, with StopReason.ERROR
and ``info["error"] = repr(exc)``; the other episodes carry on. A round's resets, and a turn's
steps, are made together (``environments.timeouts.call_all``): a call that hangs does not hold
up the others, and k hung calls cost about one timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.agent_loop.types import (
    ChatFormat,
    FSMState,
    Sampler,
    SampleResult,
    StopReason,
    Trajectory,
)
from flowrl.environments.plugin import first_user_message
from flowrl.environments.timeouts import Failed, call_all, env_call
from flowrl.environments.types import (
    OBSERVATION_ROLE_KEY,
    OBSERVATION_ROLES,
    Environment,
    StepResult,
    shown_images,
)


@dataclass(frozen=True)
class LoopLimits:
    """Budgets of one episode."""

    max_turns: int = 1
    """Policy turns per episode."""
    max_new_tokens: int = 16
    """Sampled tokens per turn (further capped by the remaining context)."""
    max_context_tokens: int = 256
    """Prompt + all turns, sampled and injected."""
    temperature: float = 1.0
    """Sampling temperature."""
    unfinished_turn_reward: float = 0.0
    """Added (<= 0) to the reward of a policy turn that ended without a stop token (cut by its
    token budget): the turn's text is still the action, so without it nothing teaches the
    policy to end its turns."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoopLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.unfinished_turn_reward > 0:
            raise ValueError(
                f"LoopLimits.unfinished_turn_reward must be <= 0, got {self.unfinished_turn_reward}"
            )

    def turn_reward(self, reward: float, stopped: bool) -> float:
        """A turn's reward: the environment's, plus the penalty of a turn cut unfinished."""
        return float(reward) + (0.0 if stopped else self.unfinished_turn_reward)


@dataclass
class _Episode:
    """Mutable bookkeeping of one episode while the loop runs."""

    env: Environment
    traj: Trajectory
    state: FSMState = FSMState.PENDING
    turns: int = 0
    truncated: bool = False
    """True when the latest turn ended without a stop token."""
    closing: list[int] = field(default_factory=list)
    """Injected before the next observation: the end-of-turn token the latest turn lacks."""
    env_info: dict[str, Any] = field(default_factory=dict)


def run_episodes(
    envs: list[Environment],
    rows: list[dict[str, Any]],
    group_ids: list[int],
    sampler: Sampler,
    chat: ChatFormat,
    limits: LoopLimits,
    episode_ids: list[str] | None = None,
) -> list[Trajectory]:
    """Play one episode per ``(env, row)`` and return their trajectories, in input order.

    ``envs[i]`` is reset with ``rows[i]``; episode ``i`` belongs to group ``group_ids[i]``.
    ``episode_ids`` default to ``"episode-{i}"``. Each trajectory's ``info`` holds the last
    ``StepResult.info`` plus ``num_turns``, ``truncated`` and (on ERROR) ``error``.
    """
    ids = episode_ids if episode_ids is not None else [f"episode-{i}" for i in range(len(envs))]
    if not len(envs) == len(rows) == len(group_ids) == len(ids):
        raise ValueError(
            f"envs, rows, group_ids and episode_ids differ in length: "
            f"{len(envs)}, {len(rows)}, {len(group_ids)}, {len(ids)}"
        )
    episodes = [
        _Episode(env, Trajectory(episode_id=eid, group_id=gid))
        for env, gid, eid in zip(envs, group_ids, ids, strict=True)
    ]
    resets = [env_call(env, "reset", _opening, **row) for env, row in zip(envs, rows, strict=True)]
    openings = call_all(resets)
    for episode, opening in zip(episodes, openings, strict=True):
        _start(episode, opening, chat, limits)
    while generating := [e for e in episodes if e.state is FSMState.GENERATING]:
        _generate_round(generating, sampler, chat, limits)
    return [e.traj for e in episodes]


def _opening(env: Environment, reset: Any) -> tuple[str, str, list[bytes]]:
    """After ``env.reset``: the first user message, the system prompt and the images shown."""
    return first_user_message(env, reset), env.get_system_prompt(), shown_images(env)


def _start(episode: _Episode, opening: Any, chat: ChatFormat, limits: LoopLimits) -> None:
    """PENDING, after the env's reset (``_opening``'s, or ``Failed``): render the opening
    messages."""
    if isinstance(opening, Failed):  # any env failure ends only this episode
        _fail(episode, _raised(opening))
        return
    user_message, system_prompt, images = opening
    messages: list[dict[str, Any]] = (
        [{"role": "system", "content": system_prompt}] if system_prompt else []
    )
    messages.append(_message("user", user_message, images))
    episode.traj.messages.extend(messages)
    episode.traj.images.extend(images)
    _append(episode.traj, chat.encode_prompt(messages))
    episode.traj.prompt_len = len(episode.traj.tokens)
    if _room(episode.traj, limits) < 1:
        _terminate(episode, StopReason.MAX_TOKENS)
    else:
        episode.state = FSMState.GENERATING


def _generate_round(
    episodes: list[_Episode], sampler: Sampler, chat: ChatFormat, limits: LoopLimits
) -> None:
    """GENERATING: one sampler call for every generating episode, then one env step each."""
    budgets = [min(limits.max_new_tokens, _room(e.traj, limits)) for e in episodes]
    prompts = [list(e.traj.tokens) for e in episodes]
    images = [list(e.traj.images) for e in episodes]
    if any(images):
        results = sampler.sample(prompts, max(budgets), limits.temperature, images=images)
    else:  # text-only samplers need not know about images
        results = sampler.sample(prompts, max(budgets), limits.temperature)
    if len(results) != len(episodes):
        raise RuntimeError(f"sampler returned {len(results)} results for {len(prompts)} prompts")
    turns = [_turn(e, r, b, chat) for e, r, b in zip(episodes, results, budgets, strict=True)]
    calls = [
        env_call(e.env, "step", _stepped, a) for e, (a, _) in zip(episodes, turns, strict=True)
    ]
    steps = call_all(calls)
    for episode, (_, stopped), step in zip(episodes, turns, steps, strict=True):
        _after_step(episode, step, stopped, chat, limits)


def _turn(
    episode: _Episode, result: SampleResult, budget: int, chat: ChatFormat
) -> tuple[str, bool]:
    """Append one turn's sampled tokens: (the action for the env, whether the turn stopped)."""
    if len(result.logprobs) != len(result.tokens):
        raise RuntimeError(
            f"sampler returned {len(result.tokens)} tokens but {len(result.logprobs)} logprobs"
        )
    # The batch was sampled with the largest budget; keep this episode's own share.
    tokens, logprobs = list(result.tokens[:budget]), list(result.logprobs[:budget])
    _append(episode.traj, tokens, logprobs)
    episode.turns += 1
    stopped = bool(tokens) and tokens[-1] in chat.stop_token_ids
    episode.truncated = not stopped
    episode.closing = chat.closing(tokens)
    text = chat.decode(tokens[:-1] if stopped else tokens)
    episode.traj.messages.append({"role": "assistant", "content": text})
    return chat.response(text), stopped


def _stepped(env: Environment, step: StepResult) -> tuple[StepResult, list[bytes]]:
    """After ``env.step``: its result and the images the env shows with the observation."""
    return step, ([] if step.done else shown_images(env))


def _after_step(
    episode: _Episode, stepped: Any, stopped: bool, chat: ChatFormat, limits: LoopLimits
) -> None:
    """Record the env's answer to a turn (``_stepped``'s, or ``Failed``); pick the next state."""
    if isinstance(stepped, Failed):  # any env failure ends only this episode
        _fail(episode, _raised(stepped))
        return
    step, images = stepped
    info = dict(step.info)
    role = info.pop(OBSERVATION_ROLE_KEY, "user")
    if role not in OBSERVATION_ROLES:
        _fail(episode, ValueError(f"observation_role must be one of {OBSERVATION_ROLES}: {role!r}"))
        return
    episode.traj.turn_rewards.append(limits.turn_reward(step.reward, stopped))
    episode.env_info = info
    if step.done:
        _terminate(episode, StopReason.DONE)
    elif episode.turns >= limits.max_turns:
        _terminate(episode, StopReason.MAX_TURNS)
    else:
        _interact(episode, _message(role, step.observation, images), images, chat, limits)


def _interact(
    episode: _Episode,
    message: dict[str, Any],
    images: list[bytes],
    chat: ChatFormat,
    limits: LoopLimits,
) -> None:
    """INTERACTING: inject the observation (mask 0) if a reply can still fit after it."""
    episode.state = FSMState.INTERACTING
    injected = episode.closing + chat.encode_turn(message)
    if len(episode.traj.tokens) + len(injected) >= limits.max_context_tokens:
        _terminate(episode, StopReason.MAX_TOKENS)
        return
    _append(episode.traj, injected)
    episode.traj.messages.append(message)
    episode.traj.images.extend(images)
    episode.state = FSMState.GENERATING


def _message(role: str, text: str, images: list[bytes]) -> dict[str, Any]:
    """A chat message: plain text, or (with images) image parts followed by the text."""
    if not images:
        return {"role": role, "content": text}
    parts: list[dict[str, str]] = [{"type": "image"} for _ in images]
    return {"role": role, "content": [*parts, {"type": "text", "text": text}]}


def _append(traj: Trajectory, tokens: list[int], logprobs: list[float] | None = None) -> None:
    """Append tokens: sampled (mask 1) when ``logprobs`` are given, injected (mask 0) otherwise."""
    traj.tokens.extend(tokens)
    traj.loss_mask.extend([1 if logprobs is not None else 0] * len(tokens))
    traj.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))


def _room(traj: Trajectory, limits: LoopLimits) -> int:
    return limits.max_context_tokens - len(traj.tokens)


def _terminate(episode: _Episode, reason: StopReason) -> None:
    episode.state = FSMState.TERMINATED
    episode.traj.stop_reason = reason
    episode.traj.info = {
        **episode.env_info,
        "num_turns": episode.turns,
        "truncated": episode.truncated,
    }


def _raised(failed: Failed) -> Exception:
    """An env's exception, to end its episode; anything else (``KeyboardInterrupt``,
    ``SystemExit``) goes on up."""
    if not isinstance(failed.error, Exception):
        raise failed.error
    return failed.error


def _fail(episode: _Episode, exc: Exception) -> None:
    _terminate(episode, StopReason.ERROR)
    episode.traj.info["error"] = repr(exc)
