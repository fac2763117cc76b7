"""Multi-agent coordinator: N agents in one environment instance, each with its own policy.

The coordinator enforces the interaction protocol (the environment says whose turn it is),
keeps one token stream per (game, agent) and attributes rewards to the agent that earned them:

- isolation: an agent's trajectory holds its own sampled tokens (mask 1) and the observations
  it was shown (mask 0) — never another agent's sampled tokens;
- turn order: in each round, every game waiting on agent A is sampled in one call of A's
  sampler, then every game waiting on B, and so on in ``env.agents`` order;
- attribution: a move's reward (e.g. an invalid-move penalty) goes to the mover; at the end of
  a game ``final_rewards()[agent]`` is added to that agent's last turn, so the outcome sits on
  its last trainable token;
- an environment that raises fails the game for every agent in it (StopReason.ERROR); the other
  games go on.

Agents may share a sampler (self-play of one policy) or have their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from flowrl.agent_loop.loop import LoopLimits
from flowrl.agent_loop.types import ChatFormat, Sampler, StopReason, Trajectory
from flowrl.environments.types import StepResult


class MultiAgentEnv(Protocol):
    """A turn-based environment among named agents (text in, text out)."""

    agents: tuple[str, ...]

    def reset(self, **row: Any) -> None: ...

    def current_agent(self) -> str | None:
        """Whose move it is; None once the game is over."""
        ...

    def observation(self, agent: str) -> str:
        """What ``agent`` is shown before its move."""
        ...

    def get_system_prompt(self, agent: str) -> str: ...

    def act(self, agent: str, action: str) -> StepResult:
        """Apply ``agent``'s move; the reward is the mover's, ``done`` ends the game."""
        ...

    def final_rewards(self) -> dict[str, float]:
        """Outcome reward of every agent once the game is over."""
        ...


@dataclass
class _Game:
    env: MultiAgentEnv
    game_id: str
    index: int
    streams: dict[str, Trajectory] = field(default_factory=dict)
    turns: dict[str, int] = field(default_factory=dict)
    over: bool = False


def run_multiagent_episodes(
    envs: list[MultiAgentEnv],
    rows: list[dict[str, Any]],
    samplers: dict[str, Sampler],
    chat: ChatFormat,
    limits: LoopLimits,
    game_ids: list[str] | None = None,
) -> dict[str, list[Trajectory]]:
    """Play every game to its end; returns each agent's trajectories (game order kept)."""
    game_ids = game_ids or [f"game-{i}" for i in range(len(envs))]
    games = [
        _start(_Game(env, gid, i), row)
        for i, (env, row, gid) in enumerate(zip(envs, rows, game_ids, strict=True))
    ]
    agents = envs[0].agents if envs else ()
    while any(not g.over for g in games):
        for agent in agents:
            waiting = [g for g in games if not g.over and g.env.current_agent() == agent]
            if waiting:
                _play_round(waiting, agent, samplers[agent], chat, limits)
    return {a: [g.streams[a] for g in games if a in g.streams] for a in agents}


def _start(game: _Game, row: dict[str, Any]) -> _Game:
    try:
        game.env.reset(**row)
    except Exception as exc:
        for agent in game.env.agents:
            game.streams[agent] = Trajectory(f"{game.game_id}-{agent}", game.index)
        _fail(game, exc)
    return game


def _play_round(
    games: list[_Game], agent: str, sampler: Sampler, chat: ChatFormat, limits: LoopLimits
) -> None:
    prompts = [_prompt(g, agent, chat) for g in games]
    budget = min(limits.max_new_tokens, max(limits.max_context_tokens - len(p) for p in prompts))
    results = sampler.sample(prompts, max(budget, 1), limits.temperature)
    for game, result in zip(games, results, strict=True):
        stream = game.streams[agent]
        stream.tokens += result.tokens
        stream.loss_mask += [1] * len(result.tokens)
        stream.logprobs += list(result.logprobs)
        stopped = result.finish_reason == "stop"
        body = result.tokens[:-1] if stopped else result.tokens
        closing = chat.closing(list(result.tokens))  # close the turn as a render would
        stream.tokens += closing
        stream.loss_mask += [0] * len(closing)
        stream.logprobs += [0.0] * len(closing)
        text = chat.decode(body)
        stream.messages.append({"role": "assistant", "content": text})
        _apply(game, agent, chat.response(text), limits, stopped)


def _prompt(game: _Game, agent: str, chat: ChatFormat) -> list[int]:
    """The agent's stream extended by what it sees now (opening prompt on its first turn)."""
    env = game.env
    observation = env.observation(agent)
    stream = game.streams.get(agent)
    if stream is None:
        stream = game.streams[agent] = Trajectory(f"{game.game_id}-{agent}", game.index)
        system = env.get_system_prompt(agent)
        opening = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": observation}
        ]
        piece = chat.encode_prompt(opening)
        stream.messages += opening
        stream.prompt_len = len(piece)
    else:
        piece = chat.encode_turn({"role": "user", "content": observation})
        stream.messages.append({"role": "user", "content": observation})
    stream.tokens += piece
    stream.loss_mask += [0] * len(piece)
    stream.logprobs += [0.0] * len(piece)
    return list(stream.tokens)


def _apply(game: _Game, agent: str, action: str, limits: LoopLimits, stopped: bool) -> None:
    stream = game.streams[agent]
    game.turns[agent] = game.turns.get(agent, 0) + 1
    try:
        result = game.env.act(agent, action)
    except Exception as exc:
        _fail(game, exc)
        return
    stream.turn_rewards.append(limits.turn_reward(result.reward, stopped))
    stream.info.update(result.info)
    out_of_turns = game.turns[agent] >= limits.max_turns
    out_of_tokens = len(stream.tokens) + 8 >= limits.max_context_tokens
    if result.done or out_of_turns or out_of_tokens:
        reason = (
            StopReason.DONE
            if result.done
            else (StopReason.MAX_TURNS if out_of_turns else StopReason.MAX_TOKENS)
        )
        _finish(game, reason)


def _finish(game: _Game, reason: StopReason) -> None:
    game.over = True
    finals = game.env.final_rewards()
    for agent, stream in game.streams.items():
        if stream.turn_rewards:
            stream.turn_rewards[-1] += float(finals.get(agent, 0.0))
        stream.stop_reason = reason
        stream.info["outcome"] = float(finals.get(agent, 0.0))


def _fail(game: _Game, exc: Exception) -> None:
    game.over = True
    for stream in game.streams.values():
        stream.stop_reason = StopReason.ERROR
        stream.info["error"] = repr(exc)
