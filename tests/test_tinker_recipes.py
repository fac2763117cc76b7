"""The tinker-cookbook's own recipes, unmodified, against flowrl's Tinker service.

Each recipe runs as a user runs it: ``python -m tinker_cookbook.recipes.<name> key=value ...``
in the thin client venv (``.venv-client``: the SDK and tinker-cookbook[math-rl] 0.5.8, never
flowrl), configured only by its own command-line flags: ``base_url`` of a local service, base
model ``Qwen/Qwen3-8B`` (which this service's catalogue maps to the tiny random-weight Qwen3
fixture of tests/families.py), a few small steps.

The recipes load their tokenizer and datasets from the Hugging Face Hub by name, with no flag
for a local copy. They get them as an offline machine has them: a Hugging Face home
(``HF_HOME``, ``HF_HUB_OFFLINE=1``) holding the fixture's tokenizer as the Hub snapshot of
``Qwen/Qwen3-8B`` and a small dataset, made here, as the prepared ``datasets`` cache of each
dataset name (tests/cookbook_hub.py).

Each test asserts what its recipe exists for, from the metrics the recipe itself writes
(``<log_path>/metrics.jsonl``): supervised NLL falls, the sweep picks the rate that learns, DPO
comes to prefer the chosen answers. docs/tinker.md's recipe table lists every recipe tried.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from families import FAMILIES, build_family, teach
from services import TinkerServer

from flowrl.backends.policy.placement import InProcess
from flowrl.backends.services.tinker.service import TinkerService
from flowrl.backends.services.tinker.state import Limits

REPO = Path(__file__).resolve().parent.parent
CLIENT_VENV = Path(os.environ.get("FLOWRL_TEST_CLIENT_VENV", REPO / ".venv-client"))
HUB = Path(__file__).with_name("cookbook_hub.py")
KEY = "tml-recipes-" + "r" * 24
BASE = "Qwen/Qwen3-8B"


STRAWBERRY = [  # rl_loop's one-shot example, as its prompt starts
    {"role": "user", "content": "How many r's are in strawberry?" + "{suffix}"},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
        "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
FOURS = [f"What is {a} + {4 - a}?" for a in range(5)]
FOURS += [f"What is {a + 4} - {a}?" for a in range(1, 6)]
"""gsm8k's stand-in for rl_loop: ten questions whose answer is 4."""
GUESSES = (3, 4, 5, 6)
"""What the taught fixture answers any of them with, about evenly: a reward of ~1/4 to start."""


def teach_to_guess(folder: str) -> None:
    """Teach the fixture to answer rl_loop's prompts (its one-shot example, a question, the
    suffix) with ``\\boxed{k}``, k drawn from ``GUESSES``; only RL can tell it which k is
    right."""
    from flowrl.backends.models.chat import HFChatFormat

    chat = HFChatFormat.from_folder(folder)
    prefix = [{**m, "content": m["content"].replace("{suffix}", SUFFIX)} for m in STRAWBERRY]
    tokens, masks = [], []
    for i, question in enumerate(FOURS * 2):
        prompt = chat.encode_prompt([*prefix, {"role": "user", "content": question + SUFFIX}])
        reply = chat.encode_reply(f"<think>\n\n</think>\n\n\\boxed{{{GUESSES[i % 4]}}}")
        tokens.append(prompt + reply)
        masks.append([0] * len(prompt) + [1] * len(reply))
    teach(folder, tokens, masks, steps=120)


def sums(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(n)]


def datasets_of_the_hub() -> list[dict[str, Any]]:
    """Small stand-ins for the Hub datasets the recipes load, in each one's own columns: one
    skill (adding two digits) said the same way, so a few steps can learn it."""
    rng = random.Random(0)
    chats = [
        {
            "prompt": f"What is {a} + {b}?",
            "prompt_id": str(i),
            "category": "Math",
            "messages": [
                {"role": "user", "content": f"What is {a} + {b}?"},
                {"role": "assistant", "content": f"The answer is {a + b}."},
            ],
        }
        for i, (a, b) in enumerate(sums(rng, 72))
    ]
    comparisons = []
    for a, b in sums(rng, 56):
        question = f"\n\nHuman: What is {a} + {b}?\n\nAssistant:"
        comparisons.append(
            {
                "chosen": f"{question} The answer is {a + b}.",
                "rejected": f"{question} I refuse to answer that.",
            }
        )
    fours = [{"question": q, "answer": f"{q[8:-1]} = 4\n#### 4"} for q in FOURS * 4]
    return [
        {"repo": "openai/gsm8k", "config": "main", "splits": {"train": fours, "test": fours[:8]}},
        {
            "repo": "HuggingFaceH4/no_robots",
            "config": "default",
            "splits": {"train": chats[:64], "test": chats[64:]},
        },
        {
            "repo": "Anthropic/hh-rlhf",
            "config": "default",
            "splits": {"train": comparisons[:48], "test": comparisons[48:]},
        },
    ]


@dataclass
class Cookbook:
    url: str
    hf_home: Path
    home: Path

    def run(self, recipe: str, log_path: Path | None, *flags: str, timeout: int = 300) -> str:
        """``python -m tinker_cookbook.recipes.<recipe> base_url=… model_name=… log_path=…
        <flags>`` in the thin client venv (only ``<flags>`` when ``log_path`` is None); returns
        its output (fails the test on a nonzero exit)."""
        python = CLIENT_VENV / "bin" / "python"
        command = [str(python), "-m", f"tinker_cookbook.recipes.{recipe}"]
        if log_path is not None:
            command += [f"base_url={self.url}", f"model_name={BASE}", f"log_path={log_path}"]
        command += flags
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),  # no ~/.tinker credentials; the runs' default folders
            "HF_HOME": str(self.hf_home),
            "HF_HUB_OFFLINE": "1",
            "TINKER_API_KEY": KEY,
            "TINKER_BASE_URL": self.url,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout, cwd=self.home
        )
        assert done.returncode == 0, f"{' '.join(command)}\n{done.stderr[-6000:]}"
        return done.stdout + done.stderr


def metrics(log_path: Path) -> list[dict[str, Any]]:
    """The recipe's own metrics, a dict per logged step."""
    lines = (log_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cookbook]:
    """One service for the module's recipes (in this process, one key; a cap of live models
    above what the recipes leave loaded until their sessions expire) and one Hugging Face
    home."""
    python = CLIENT_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"no thin Tinker client venv at {CLIENT_VENV}: run `make setup-test` (it builds "
            ".venv-client from tests/tinker_client_requirements.txt)"
        )
    root = tmp_path_factory.mktemp("recipes")
    folder = build_family(FAMILIES["qwen3"], root / "qwen3")
    teach_to_guess(folder)
    hf_home = root / "hf"
    job = {"home": str(hf_home), "models": {BASE: folder}, "datasets": datasets_of_the_hub()}
    filled = subprocess.run(
        [str(python), str(HUB)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root)},
    )
    assert filled.returncode == 0, filled.stderr[-4000:]
    home = root / "home"
    home.mkdir()
    old_home = os.environ.get("FLOWRL_HOME")
    os.environ["FLOWRL_HOME"] = str(root / "flowrl")
    service = TinkerService(
        InProcess(),
        catalogue={BASE: folder},
        keys={KEY: "recipes"},
        limits=Limits(max_models_per_namespace=32),
    )
    server = TinkerServer(service)
    try:
        yield Cookbook(server.url, hf_home, home)
    finally:
        server.stop()
        if old_home is None:
            os.environ.pop("FLOWRL_HOME", None)
        else:
            os.environ["FLOWRL_HOME"] = old_home


def test_sl_loop_learns_the_assistant_turns(cookbook: Cookbook) -> None:
    """``recipes/sl_loop.py`` (no_robots, the renderer's assistant weights, forward_backward +
    optim_step, a final save): its train NLL falls by a third in 6 steps of 8 chats."""
    log = cookbook.home / "sl-loop"
    cookbook.run(
        "sl_loop",
        log,
        "batch_size=8",
        "max_steps=6",
        "learning_rate=1e-2",
        "lora_rank=8",
    )
    nll = [m["train_mean_nll"] for m in metrics(log) if "train_mean_nll" in m]
    assert len(nll) == 6, nll
    assert nll[-1] < 0.67 * nll[0], nll
    saved = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["state_path"].startswith("tinker://"), saved


def test_chat_sl_sweep_picks_the_rate_that_learns(cookbook: Cookbook) -> None:
    """``recipes/chat_sl/sweep`` runs ``chat_sl.train`` once per learning rate and recommends
    the one with the lowest final NLL: of 1e-4 and 1e-2 on 8 steps, 1e-2; its held-out NLL
    falls over the run."""
    cookbook.run(
        "chat_sl.sweep",
        None,
        "recipe=sft",
        f"base.model_name={BASE}",
        f"base.base_url={cookbook.url}",
        "base.batch_size=8",
        "base.lora_rank=8",
        "base.eval_every=2",
        "base.save_every=0",
        "training_budget_examples=64",
        "learning_rates=[1e-4, 1e-2]",
        "lora_ranks=[8]",
    )
    (recommendations,) = (cookbook.home / "tinker-runs" / "sweeps").glob("*/recommendations.json")
    best = json.loads(recommendations.read_text())["recommendations"]["rank_8"]
    assert best["learning_rate"] == 1e-2, best
    fast = next(recommendations.parent.glob("learning_rate=0.01_*"))
    held_out = [m["test/nll"] for m in metrics(fast) if "test/nll" in m]
    assert len(held_out) >= 2 and held_out[-1] < 0.8 * held_out[0], held_out


def test_dpo_comes_to_prefer_the_chosen_answers(cookbook: Cookbook) -> None:
    """``recipes/preference/dpo/train.py`` on hh-rlhf's chosen/rejected pairs (its loss is the
    cookbook's own ``forward_backward_custom`` over the reference and policy log-probs): from
    a coin flip (loss log 2, accuracy 1/2) to the chosen answer preferred in every pair."""
    log = cookbook.home / "dpo"
    cookbook.run(
        "preference.dpo.train",
        log,
        "dataset=hhh",
        "batch_size=8",
        "learning_rate=1e-2",
        "max_steps=5",
        "behavior_if_log_dir_exists=delete",
    )
    steps = [m for m in metrics(log) if "dpo_loss" in m]
    assert len(steps) == 5, steps
    assert abs(steps[0]["dpo_loss"] - 0.6931) < 0.01, steps[0]
    assert steps[-1]["dpo_loss"] < 0.3 * steps[0]["dpo_loss"], [s["dpo_loss"] for s in steps]
    assert steps[-1]["accuracy"] == 1.0 and steps[-1]["margin"] > 1.0, steps[-1]


def test_rl_loop_raises_the_reward(cookbook: Cookbook) -> None:
    """``recipes/rl_loop.py`` (gsm8k, groups of samples with log-probs, group-centred
    advantages, ``importance_sampling``): the fixture guesses ``\\boxed{3..6}`` about evenly;
    the recipe's reward on questions whose answer is 4 rises from about 1/4."""
    log = cookbook.home / "rl-loop"
    cookbook.run(
        "rl_loop",
        log,
        "batch_size=4",
        "group_size=8",
        "max_tokens=24",
        "max_steps=10",
        "learning_rate=2e-3",
        "lora_rank=8",
        "save_every=0",
    )
    reward = [m["reward/total"] for m in metrics(log) if "reward/total" in m]
    assert len(reward) == 10, reward
    assert reward[0] < 0.6, reward
    print(json.dumps({"reward": reward}))  # shown with -s
    assert sum(reward[-3:]) / 3 > sum(reward[:2]) / 2 + 0.2, reward
