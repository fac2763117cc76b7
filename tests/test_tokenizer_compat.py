"""A flowrl model folder's tokenizer loads in transformers 4.x as well as 5.x (older TRL and
vLLM releases pin 4.x): same class family, same special tokens, same chat-template token ids.

transformers 4.57.3 (with the tokenizers and huggingface-hub it needs) is pip-installed into a
temporary folder from the package registry and run in a subprocess beside the suite's 5.x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.backends.models.model_folder import load_tokenizer
from flowrl.backends.models.tiny_model import TinyModelSpec, build_tiny_model

OLD = ["transformers==4.57.3", "tokenizers==0.22.1", "huggingface-hub==0.36.0"]
CONVERSATION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "12+3="},
]
PROBE = """
import json, sys
import transformers
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok.apply_chat_template(
    json.loads(sys.argv[2]), add_generation_prompt=True, tokenize=True, return_dict=False
)
ids = [int(i) for i in ids]
print(json.dumps({"version": transformers.__version__, "class": type(tok).__name__,
                  "special": sorted(tok.all_special_tokens), "ids": ids,
                  "eos": tok.eos_token, "pad": tok.pad_token}))
"""


@pytest.fixture(scope="module")
def transformers_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("transformers-4")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *OLD],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return target


def _probe(folder: str, pythonpath: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, folder, json.dumps(CONVERSATION)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tokenizer_files_load_the_same_in_transformers_4_and_5(transformers_4, tmp_path):
    folder = build_tiny_model(TinyModelSpec(), str(tmp_path / "tiny"))
    config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    old = _probe(folder, str(transformers_4))
    new = _probe(folder, "")
    assert old["version"].startswith("4.") and new["version"].startswith("5.")
    assert old["class"] == "PreTrainedTokenizerFast"
    for key in ("special", "ids", "eos", "pad"):
        assert old[key] == new[key], key
    assert {"<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"} <= set(old["special"])
    # and flowrl's own loader reads the same tokens
    ours = load_tokenizer(folder).apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(ours) == new["ids"]
