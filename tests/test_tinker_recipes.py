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

import base64
import io
import itertools
import json
import os
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from families import FAMILIES, Family, build_family, build_qwen3_vl, teach
from services import TinkerServer

from flowrl.backends.policy.placement import InProcess
from flowrl.backends.services.tinker.service import TinkerService
from flowrl.backends.services.tinker.state import Limits

REPO = Path(__file__).resolve().parent.parent
CLIENT_VENV = Path(os.environ.get("FLOWRL_TEST_CLIENT_VENV", REPO / ".venv-client"))
HUB = Path(__file__).with_name("cookbook_hub.py")
KEY = "tml-recipes-" + "r" * 24
BASE = "Qwen/Qwen3-8B"
DEEPSEEK = "deepseek-ai/DeepSeek-V3.1"
VL = "Qwen/Qwen3-VL-30B-A3B-Instruct"
PHOTOS = {"sunflower": (230, 200, 40), "airplanes": (60, 120, 230)}
"""caltech101's stand-in for vlm_classifier: two classes, each photo a 64x64 field of its
class's color, jittered."""

RECIPE_SEED = 0
SEEDED = """
import functools, runpy, sys
from tinker import ServiceClient

seed, module = int(sys.argv[1]), sys.argv[2]
for name in ("create_lora_training_client", "create_lora_training_client_async"):
    def seeded(*args, _create=getattr(ServiceClient, name), **kwargs):
        if len(args) < 4:  # self, base_model, rank, seed
            kwargs.setdefault("seed", seed)
        return _create(*args, **kwargs)
    setattr(ServiceClient, name, functools.wraps(getattr(ServiceClient, name))(seeded))
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
"""The recipe run as ``python -m <module>`` with its LoRA training clients created from a fixed
seed where it names none (the cookbook's recipes name none, and the service, as Tinker's, then
draws a random one): a user's ``seed=`` in ``create_lora_training_client``. The adapter's init
and the sampling RNG follow from it (``TinkerModel``), so a recipe's metrics are the same run
after run: vlm_classifier's final accuracy was 0.5 in one CI run of random seeds and 1.0 in the
others."""

_S = chr(65372)  # DeepSeek's full-width bar: <｜User｜>
DEEPSEEK_SPECIALS = tuple(
    f"<{_S}{name}{_S}>"
    for name in (
        "begin▁of▁sentence",
        "end▁of▁sentence",
        "User",
        "Assistant",
        "tool▁calls▁begin",
        "tool▁calls▁end",
        "tool▁call▁begin",
        "tool▁call▁end",
        "tool▁sep",
        "tool▁output▁begin",
        "tool▁output▁end",
    )
)
DEEPSEEK_FAMILY = Family(
    "deepseek_v3",
    "qwen3",
    DEEPSEEK_SPECIALS,
    ("<think>", "</think>"),
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
    + DEEPSEEK_SPECIALS[2]
    + "{{ m.content }}{% elif m.role == 'assistant' %}"
    + DEEPSEEK_SPECIALS[3]
    + "{{ m.content }}"
    + DEEPSEEK_SPECIALS[1]
    + "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + DEEPSEEK_SPECIALS[3] + "{% endif %}",
    eos=DEEPSEEK_SPECIALS[1],
    generation_eos=(DEEPSEEK_SPECIALS[1],),
    pad=DEEPSEEK_SPECIALS[1],
    bos=DEEPSEEK_SPECIALS[0],
)
"""A tiny model with DeepSeek V3's special tokens, each one token as the cookbook's
``deepseekv3`` renderer needs: rl_numerics_check's environment declares a tool, and of the
renderers with tools it is the one whose tokenizer calls are safe from the threads the recipe
renders in (the ``qwen3`` renderer's switch of ``split_special_tokens`` is not: ``RuntimeError:
Already borrowed``)."""


STRAWBERRY = [  # rl_loop's one-shot example, as its prompt starts
    {"role": "user", "content": "How many r's are in strawberry?" + "{suffix}"},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
        "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
MATH_ENV_SUFFIX = " Write your answer in \\boxed{} format."  # math_rl's MathEnv asks so
FOURS = [f"What is {a} + {4 - a}?" for a in range(5)]
FOURS += [f"What is {a + 4} - {a}?" for a in range(1, 6)]
"""gsm8k's stand-in for rl_loop: ten questions whose answer is 4."""
GUESSES = (3, 4, 5, 6)
"""What the taught fixture answers any of them with, about evenly: a reward of ~1/4 to start."""


def untie(folder: str) -> None:
    """Give the fixture an unembedding of its own (a copy of its embedding), as Qwen3-8B has:
    an adapter on the unembedding then merges into it alone (PEFT's merge and the cookbook's
    both need that)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(folder)


def teach_to_guess(folder: str) -> None:
    """Teach the fixture to answer rl_loop's and math_rl's gsm8k prompts (their one-shot
    example, whose suffix differs, a question, the suffix) with ``\\boxed{k}``, k drawn from
    ``GUESSES``; only RL can tell it which k is right."""
    from flowrl.backends.models.chat import HFChatFormat

    chat = HFChatFormat.from_folder(folder)
    tokens, masks = [], []
    for i, question in enumerate(FOURS * 2):
        suffix = (SUFFIX, MATH_ENV_SUFFIX)[i % 2]  # each asks in its own words, twice
        opening = [{**m, "content": m["content"].replace("{suffix}", suffix)} for m in STRAWBERRY]
        prompt = chat.encode_prompt([*opening, {"role": "user", "content": question + suffix}])
        reply = chat.encode_reply(f"<think>\n\n</think>\n\n\\boxed{{{GUESSES[i // 2 % 4]}}}")
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
    fours = [{"question": q, "answer": f"{q[8:-1]} = 4\n#### 4"} for q in FOURS * 8]
    photos = {"train": photos_of(rng, 8), "test": photos_of(rng, 4)}
    words = "the cat sat after the rain before the war although it was late against the wall"
    pages = [" ".join(rng.choice(words.split()) for _ in range(60)) for _ in range(200)]
    return [
        {
            "repo": "Salesforce/wikitext",
            "config": "wikitext-103-raw-v1",
            "splits": {"train": [{"text": page} for page in pages]},
        },
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
        {"repo": "zwhe99/DeepMath-103K", "splits": {"train": [{"question": q} for q in FOURS * 8]}},
        {"repo": "hicai-zju/SciKnowEval", "splits": {"test": sciknoweval(random.Random(0), 60)}},
        {
            "repo": "dpdl-benchmark/caltech101",
            "splits": photos,
            "features": {"image": "image", "label": {"names": list(PHOTOS)}},
        },
    ]


def sciknoweval(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """SciKnowEval's stand-in for sdft: ``n`` L3 Chemistry multiple-choice rows in its columns
    (a sum, four options, the right one's letter)."""
    rows = []
    for a, b in sums(rng, n):
        options = [a + b, a + b + 1, a + b - 1, a + b + 2]
        rng.shuffle(options)
        rows.append(
            {
                "domain": "Chemistry",
                "details": {"level": "L3"},
                "type": "mcq-4-choices",
                "question": f"What is {a} + {b}?",
                "choices": {"label": list("ABCD"), "text": [str(o) for o in options]},
                "answerKey": "ABCD"[options.index(a + b)],
            }
        )
    return rows


def photos_of(rng: random.Random, per_class: int) -> list[dict[str, Any]]:
    """``per_class`` photos of each ``PHOTOS`` class (base64 PNG, the label's index)."""
    from PIL import Image

    rows = []
    for label, rgb in enumerate(PHOTOS.values()):
        for _ in range(per_class):
            color = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in rgb)
            buffer = io.BytesIO()
            Image.new("RGB", (64, 64), color).save(buffer, format="PNG")
            rows.append({"image": base64.b64encode(buffer.getvalue()).decode(), "label": label})
    return rows


@dataclass
class Cookbook:
    url: str
    hf_home: Path
    home: Path
    folder: str
    """The fixture that ``Qwen/Qwen3-8B`` is here."""

    def run(
        self,
        recipe: str,
        log_path: Path | None,
        *flags: str,
        timeout: int = 300,
        seed: int = RECIPE_SEED,
    ) -> str:
        """``python -m tinker_cookbook.recipes.<recipe> base_url=… model_name=… log_path=…
        <flags>`` in the thin client venv (only ``<flags>`` when ``log_path`` is None; another
        module of the cookbook by its full name; ``python <flags>`` for ``""``); returns its
        output (fails the test on a nonzero exit). A recipe's LoRA clients start from ``seed``
        (``SEEDED``)."""
        python = CLIENT_VENV / "bin" / "python"
        module = (
            recipe if recipe.startswith("tinker_cookbook.") else f"tinker_cookbook.recipes.{recipe}"
        )
        command = [str(python), "-c", SEEDED, str(seed), module] if recipe else [str(python)]
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
    untie(folder)
    models = {
        BASE: folder,
        DEEPSEEK: build_family(DEEPSEEK_FAMILY, root / "deepseek"),
        VL: build_qwen3_vl(root / "qwen3-vl"),
    }
    hf_home = root / "hf"
    job = {"home": str(hf_home), "models": models, "datasets": datasets_of_the_hub()}
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
        catalogue=models,
        keys={KEY: "recipes"},
        limits=Limits(max_models_per_namespace=32),
    )
    server = TinkerServer(service)
    try:
        yield Cookbook(server.url, hf_home, home, folder)
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


def test_rl_numerics_check_sampler_and_trainer_agree(cookbook: Cookbook) -> None:
    """``recipes/rl_numerics_check`` (a multi-turn counting task over WikiText pages, a tool
    declared; ``rl.train``'s sync loop): the KL between the sampler's log-probs and the
    trainer's on the same tokens, the health signal the cookbook tells users to watch, is
    under 1e-3 at every step (both are flowrl's fp32 model)."""
    log = cookbook.home / "numerics"
    cookbook.run(
        "rl_numerics_check.train",
        None,
        f"base_url={cookbook.url}",
        f"model_name={DEEPSEEK}",
        f"log_path={log}",
        "lora_rank=8",
        "learning_rate=1e-3",
        "group_size=2",
        "groups_per_batch=2",
        "max_tokens=16",
        "max_steps=3",
        "task.num_pages_min=1",
        "task.num_pages_max=2",
        "task.page_chars=200",
        "save_every=0",
        "behavior_if_log_dir_exists=delete",
    )
    steps = [m for m in metrics(log) if "optim/kl_sample_train_v2" in m]
    print(json.dumps({"kl": [m["optim/kl_sample_train_v2"] for m in steps]}))  # shown with -s
    assert len(steps) == 3, steps
    for step in steps:
        assert 0 <= step["optim/kl_sample_train_v2"] < 1e-3, step
        assert abs(step["optim/kl_sample_train_v1"]) < 1e-3, step


def test_weights_download_and_merge_generate_as_the_sampler(cookbook: Cookbook) -> None:
    """A user's way out: ``sl_loop`` trains; the cookbook's ``weights.download`` fetches its
    final state (the service exports it as external weights, age-encrypted to a key made for
    the download, by signed URLs; the cookbook decrypts it and deletes the export); the
    cookbook's merge script folds the adapter into the base. ``transformers`` loads the merged
    model, and it answers with the service's sampler's greedy tokens and log-probs."""
    import tinker
    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log, adapter, merged = (cookbook.home / name for name in ("sl-out", "adapter", "merged"))
    flags = ("batch_size=8", "max_steps=3", "learning_rate=1e-2", "lora_rank=8", "save_every=0")
    cookbook.run("sl_loop", log, *flags)
    final = json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])
    download = (
        "from tinker_cookbook import weights; "
        f"weights.download(tinker_path={final['state_path']!r}, output_dir={str(adapter)!r})"
    )
    cookbook.run("", None, "-c", download)
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    merge = "tinker_cookbook.scripts.merge_tinker_adapter_to_hf_model"
    cookbook.run(
        merge,
        None,
        "--hf-model",
        cookbook.folder,
        "--tinker-adapter-path",
        str(adapter),
        "--output-path",
        str(merged),
    )

    tokenizer = AutoTokenizer.from_pretrained(merged)
    text = (
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    prompt = tokenizer.encode(text)
    client = tinker.ServiceClient(base_url=cookbook.url, api_key=KEY)
    sampler = client.create_sampling_client(model_path=final["sampler_path"])
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    served = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        tokens = out[0, len(prompt) :].tolist()
        logits = model(out[:, : len(prompt) + len(served.tokens)]).logits[0].float()
    print(json.dumps({"merged_says": tokenizer.decode(tokens)}))  # shown with -s
    assert tokens == served.tokens, (tokens, served.tokens, tokenizer.decode(tokens))
    logprobs = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    mine = logprobs.gather(1, torch.tensor(served.tokens)[:, None])[:, 0]
    assert torch.allclose(mine, torch.tensor(served.logprobs), atol=1e-4)
    client.close("success").result()


def test_math_rl_async_raises_the_reward(cookbook: Cookbook) -> None:
    """``recipes/math_rl/train.py`` on gsm8k with its async loop (``max_steps_off_policy=2``:
    sampling runs up to two steps ahead of training, on older weights): the fixture that
    guesses ``\\boxed{3..6}`` learns that the answer is 4."""
    log = cookbook.home / "math-rl"
    cookbook.run(
        "math_rl.train",
        None,
        f"base_url={cookbook.url}",
        f"model_name={BASE}",
        f"log_path={log}",
        "env=gsm8k",
        "lora_rank=8",
        "group_size=8",
        "groups_per_batch=4",
        "max_tokens=24",
        "learning_rate=1e-3",
        "max_steps=20",
        "max_steps_off_policy=2",
        "loss_fn=ppo",
        "eval_every=0",
        "save_every=0",
        "behavior_if_log_dir_exists=delete",
    )
    reward = [m["env/all/reward/total"] for m in metrics(log) if "env/all/reward/total" in m]
    print(json.dumps({"math_rl_reward": reward}))  # shown with -s
    assert len(reward) >= 8, reward  # the async loop logs the steps it trained
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.15, reward


def test_vlm_classifier_learns_to_name_the_photos(cookbook: Cookbook) -> None:
    """``recipes/vlm_classifier/train`` (caltech101: image chunks in training, its NLL evaluator
    and its sampling evaluator) on a tiny Qwen3-VL: the classes' names are learned from the
    photos alone, so its test accuracy rises from 0 to all."""
    out = cookbook.home / "vlm"
    cookbook.run(
        "vlm_classifier.train",
        None,
        f"experiment_dir={out}",
        f"base_url={cookbook.url}",
        f"model_name={VL}",
        "renderer_name=qwen3_vl_instruct",
        "batch_size=8",
        "num_epochs=150",
        "learning_rate=1e-2",
        "lr_schedule=constant",
        "lora_rank=8",
        "eval_every=75",
        "save_every=100",
        "infrequent_eval_every=100",
        "n_eval=8",
        "max_tokens=16",
        timeout=600,
    )
    (log,) = list(out.iterdir())
    rows = metrics(log)
    evals = [r for r in rows if "accuracy" in r]
    assert [r["step"] for r in evals] == [0, 75, 150, 225], evals
    assert evals[0]["accuracy"] == 0.0, evals  # a random model names nothing
    assert evals[-1]["accuracy"] >= 0.875, evals
    assert evals[-1]["test/nll"] < 0.1 * evals[0]["test/nll"], evals


def _taught(
    cookbook: Cookbook,
    answers: tuple[object, ...],
    questions: list[str] = FOURS,
    form: str = "\\boxed{{{}}}",
    seed: int = 0,
    learning_rate: float = 5e-3,
) -> Any:
    """A training client of ``Qwen/Qwen3-8B`` with an adapter taught (30 SL steps through the
    SDK) to answer each of ``questions`` (deepmath's stand-in) with ``form`` of k
    (``\\boxed{k}``), k one of ``answers`` about evenly. Its adapter starts from ``seed``: the
    same client every run. Adam at ``learning_rate``: at 1e-2, one seed of four gave a taught
    answer -6.8, not ~0 (a CI run's student, -5); at 5e-3 none of four did."""
    import tinker
    from tinker import types

    from flowrl.backends.models.chat import HFChatFormat

    chat = HFChatFormat.from_folder(cookbook.folder)
    data = []
    for question, answer in itertools.product(questions, answers):
        reply = chat.encode_reply("<think>\n\n</think>\n\n" + form.format(answer))
        prompt = chat.encode_prompt([{"role": "user", "content": question}])
        tokens = prompt + reply
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(reply)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    client = tinker.ServiceClient(base_url=cookbook.url, api_key=KEY)
    trainer = client.create_lora_training_client(base_model=BASE, rank=8, seed=seed)
    for _ in range(30):
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
    return trainer


def test_on_policy_distillation_brings_the_student_to_its_teacher(cookbook: Cookbook) -> None:
    """``recipes/distillation/on_policy_distillation`` (deepmath's prompts; teacher and
    student checkpoints on one base, taught to answer 4 and 7): the student comes to answer
    as its teacher does. Its final checkpoint gives the teacher's ``\\boxed{4}`` far more
    log-probability, and the ``\\boxed{7}`` it was also taught far less, than it did before."""
    import tinker
    from tinker import types

    from flowrl.backends.models.chat import HFChatFormat

    client = tinker.ServiceClient(base_url=cookbook.url, api_key=KEY)
    chat = HFChatFormat.from_folder(cookbook.folder)

    def logprob(path: str, answer: int) -> float:
        """The sampler at ``path``'s log-prob of replying ``\\boxed{answer}``, mean over the
        questions."""
        sampler = client.create_sampling_client(model_path=path)
        reply = chat.encode_reply(f"<think>\n\n</think>\n\n\\boxed{{{answer}}}")
        total = 0.0
        for question in FOURS:
            prompt = chat.encode_prompt([{"role": "user", "content": question}])
            scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + reply))
            total += sum(scored.result()[len(prompt) :])
        return total / len(FOURS)

    teacher = _taught(cookbook, (4,), seed=1).save_weights_for_sampler("teacher").result().path
    taught = _taught(cookbook, (4, 7), seed=2)
    student = taught.save_state("student").result().path
    before_path = taught.save_weights_for_sampler("student-before").result().path
    # measured before the recipe runs (an untaught adapter gives -17 and -28)
    before = {k: logprob(before_path, k) for k in (4, 7)}
    assert before[7] > -2.5, before  # taught: 7 about as often as 4
    log = cookbook.home / "distill"
    cookbook.run(
        "distillation.on_policy_distillation",
        log,
        f"teacher_model={BASE}",
        f"teacher_checkpoint={teacher}",
        f"load_checkpoint_path={student}",
        "dataset=deepmath",
        "groups_per_batch=4",
        "group_size=4",
        "max_tokens=24",
        # 2e-3 drove a run's student to repeat </think> (the teacher's log-prob of 7 is ~-40:
        # the first step's gradient norm was 2,400)
        "learning_rate=1e-3",
        "lora_rank=8",
        "max_steps=16",
        "eval_every=0",
        "save_every=0",
    )
    kl = [m["teacher_kl"] for m in metrics(log) if "teacher_kl" in m]
    assert len(kl) == 16, kl
    # teacher_kl, the recipe's signal, is an estimate from 16 samples a step: a student that
    # answers 7 half the time reads ~0 or ~1 by the luck of the draw (runs began 0.42, 0.06
    # and 0.32, 1.14, 1.20). What the student gives each answer is measured exactly.
    final = json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])
    after = {k: logprob(final["sampler_path"], k) for k in (4, 7)}
    print(json.dumps({"kl": kl, "before": before, "after": after}))  # shown with -s
    assert after[7] < before[7] - 2.0, (before, after)
    assert after[4] > before[4], (before, after)


def test_sdft_teaches_the_student_what_its_teacher_answers(cookbook: Cookbook) -> None:
    """``recipes/sdft/train.py`` (SciKnowEval's multiple-choice questions) with its top-k
    distillation: the teacher is the base model shown the golden answer as a demonstration,
    the student sees the question alone and is trained on its own samples towards the
    teacher's top-k next tokens (the teacher's ``topk_prompt_logprobs``; ``cross_entropy`` on
    the SDK's sparse 2-D ``(N, K)`` targets and weights). The student starts from a checkpoint
    taught to answer ``<answer>A</answer>`` to every question; after SDFT it gives that reply
    far less, and the teacher's own (greedy) replies far more, than it did."""
    import tinker
    from tinker import types

    from flowrl.backends.models.chat import HFChatFormat

    rows = sciknoweval(random.Random(0), 60)  # as datasets_of_the_hub's draws them
    questions = [
        f"{row['question']}\n\n"
        + "\n".join(
            f"{k}: {t}"
            for k, t in zip(row["choices"]["label"], row["choices"]["text"], strict=True)
        )
        + "\nPlease reason step by step, then give your answer as <answer>X</answer> where X "
        "is the letter of the correct option."
        for row in rows
    ]
    student = _taught(cookbook, ("A",), questions, "<answer>{}</answer>", learning_rate=1e-2)
    log = cookbook.home / "sdft"
    cookbook.run(
        "sdft.train",
        log,
        f"load_checkpoint_path={student.save_state('sdft-student').result().path}",
        "dataset=sciknoweval",
        "groups_per_batch=4",
        "group_size=2",
        "topk=5",
        "max_tokens=24",
        "learning_rate=5e-3",
        "lora_rank=8",
        "max_steps=12",
        "eval_every=0",
        "save_every=0",
        "behavior_if_log_dir_exists=delete",
    )
    done = [m for m in metrics(log) if "sdft/mean_teacher_entropy" in m]
    assert len(done) == 12, done
    final = json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])
    client = tinker.ServiceClient(base_url=cookbook.url, api_key=KEY)
    chat = HFChatFormat.from_folder(cookbook.folder)
    teacher = client.create_sampling_client(base_model=BASE)
    greedy = types.SamplingParams(max_tokens=24, temperature=0.0)
    taught = chat.encode_reply("<think>\n\n</think>\n\n<answer>A</answer>")
    replies: dict[str, list[list[int]]] = {"taught": [], "teacher": []}
    prompts = []
    for row, question in zip(rows[:8], questions[:8], strict=True):
        shown = question + "\n\nThis is an example for a response to the question:\n"
        shown += row["answerKey"] + "\n\nNow answer with a response of your own, including "
        shown += "the thinking process."  # the recipe's DEFAULT_DEMO_TEMPLATE
        reply = teacher.sample(
            types.ModelInput.from_ints(chat.encode_prompt([{"role": "user", "content": shown}])),
            1,
            greedy,
        ).result()
        prompts.append(chat.encode_prompt([{"role": "user", "content": question}]))
        replies["teacher"].append(list(reply.sequences[0].tokens))
        replies["taught"].append(taught)

    def mean_logprob(path: str, which: str) -> float:
        """The sampler at ``path``'s mean log-prob per token of ``which`` replies."""
        sampler = client.create_sampling_client(model_path=path)
        total = count = 0.0
        for prompt, reply in zip(prompts, replies[which], strict=True):
            scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + reply)).result()
            total += sum(scored[len(prompt) :])
            count += len(reply)
        return total / count

    before_path = student.save_weights_for_sampler("sdft-before").result().path
    before = {w: mean_logprob(before_path, w) for w in replies}
    after = {w: mean_logprob(final["sampler_path"], w) for w in replies}
    print(json.dumps({"before": before, "after": after}))  # shown with -s
    assert after["taught"] < before["taught"] - 1.5, (before, after)
    assert after["teacher"] > before["teacher"] + 1.0, (before, after)
