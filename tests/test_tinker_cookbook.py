"""``tinker-cookbook``'s supervised path, unchanged, against flowrl's Tinker service.

The cookbook (0.5.8) pins ``transformers<=5.5.4`` and cannot share flowrl's venv, so it runs
where a user's would: a thin client venv (``.venv-client``, built by ``make setup-test`` from
tests/tinker_client_requirements.txt) that has only ``tinker``, the cookbook and their
dependencies. The client (tests/tinker_cookbook_client.py) renders chats with the cookbook's
``qwen3`` renderer over a tiny Qwen3-family fixture (tests/families.py), turns them into datums
with ``conversation_to_datum`` and trains a LoRA adapter on the service through the SDK.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from families import FAMILIES, build_family
from services import TinkerServer

from flowrl.backends.policy.placement import InProcess
from flowrl.backends.services.tinker.service import TinkerService

REPO = Path(__file__).resolve().parent.parent
CLIENT_VENV = Path(os.environ.get("FLOWRL_TEST_CLIENT_VENV", REPO / ".venv-client"))
CLIENT = Path(__file__).with_name("tinker_cookbook_client.py")
KEY = "tml-cookbook-" + "c" * 24
BASE = "Qwen/Qwen3-tiny"
STEPS = 15

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": "The answer is 408."},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 5 * 5?"},
        {"role": "assistant", "content": "25"},
    ],
    [
        {"role": "user", "content": "Your move (row,col):"},
        {"role": "assistant", "content": "1,2"},
    ],
]


def expected_weighted(conversation: list[dict]) -> str:
    """The assistant turns as Qwen3's template writes them: each reply and its <|im_end|>, the
    last one after an (empty) think block; nothing of the user's or the system's."""
    replies = [m["content"] for m in conversation if m["role"] == "assistant"]
    *history, last = replies
    return "".join(f"{r}<|im_end|>" for r in history) + f"<think>\n\n</think>\n\n{last}<|im_end|>"


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """The service in this process (``TinkerServer``), one namespace, a catalogue of the one
    fixture model; yields its URL and the fixture's folder."""
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "home"))
    folder = build_family(FAMILIES["qwen3"], tmp_path / "qwen3")
    service = TinkerService(InProcess(), catalogue={BASE: folder}, keys={KEY: "cookbook"})
    server = TinkerServer(service)
    try:
        yield server.url, folder
    finally:
        server.stop()


def test_cookbook_sft_on_qwen3_fixture(server: tuple[str, str], tmp_path: Path) -> None:
    """The cookbook's renderer weights only the assistant tokens (its tokens are the fixture
    template's), those weights reach the server (its ``loss:sum`` is the weighted NLL), and 15
    steps of ``forward_backward`` + ``optim_step`` from the thin client bring the NLL down."""
    python = CLIENT_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"no thin Tinker client venv at {CLIENT_VENV}: run `make setup-test` (it builds "
            ".venv-client from tests/tinker_client_requirements.txt)"
        )
    url, folder = server
    job = {
        "folder": folder,
        "renderer": "qwen3",
        "base_model": BASE,
        "conversations": CONVERSATIONS,
        "steps": STEPS,
        "learning_rate": 3e-3,
        "rank": 8,
        "seed": 0,
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),  # no ~/.tinker credentials, no HF cache of the user's
        "TINKER_BASE_URL": url,
        "TINKER_API_KEY": KEY,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(
        [str(python), str(CLIENT)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if done.returncode != 0 and "ModuleNotFoundError" in done.stderr:
        pytest.fail(f"{CLIENT_VENV} lacks a package: run `make setup-test`\n{done.stderr[-3000:]}")
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({"nll": [round(s["nll"], 4) for s in report["steps"]]}))  # shown with -s

    assert BASE in report["models"]
    for datum, conversation in zip(report["datums"], CONVERSATIONS, strict=True):
        assert datum["matches_template"], datum
        assert datum["shifted"], datum
        assert math.isclose(datum["weight_sum"], 1.0, rel_tol=1e-5)  # reduction="mean"
        assert datum["weighted"] == expected_weighted(conversation), datum
        for message in conversation:
            if message["role"] != "assistant":
                assert message["content"] in datum["unweighted"], (message, datum)
        assert 0 < datum["weighted_tokens"] < datum["tokens"] - 1

    steps = report["steps"]
    assert len(steps) == STEPS
    for step in steps:
        # loss:sum = Σ -w·logprob over the batch; each datum's weights sum to 1.
        mean = step["loss_sum"] / len(CONVERSATIONS)
        assert math.isclose(step["nll"], mean, rel_tol=1e-4), step
    nll = [s["nll"] for s in steps]
    assert all(math.isfinite(x) for x in nll)
    assert nll[-1] < 0.7 * nll[0], nll
