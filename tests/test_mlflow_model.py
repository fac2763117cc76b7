"""A registered version is an MLflow Model: pyfunc loads and generates, ``mlflow models serve``
answers on loopback, the version carries its lineage, and no ``mlruns/`` appears in the working
directory. Real MLflow (SQLite store, artifacts under FLOWRL_HOME), a tiny random model."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import torch

from flowrl.backends.models.chat import HFChatFormat
from flowrl.backends.models.mlflow_model import save_chat_model
from flowrl.backends.models.model_folder import load_causal_lm, load_tokenizer
from flowrl.backends.models.model_uri import resolve_model_uri
from flowrl.backends.models.tiny_model import TinyModelSpec, build_tiny_model
from flowrl.infra import tracking
from flowrl.infra.servers import free_port, wait_for_http
from flowrl.infra.settings import get_settings

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def greedy_reply(hf_dir: str, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    """The reference: the same HF folder, generated with transformers directly."""
    chat = HFChatFormat(load_tokenizer(hf_dir), sanitize_control_tokens=True)
    prompt = chat.encode_prompt(messages)
    model = load_causal_lm(hf_dir)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=chat.stop_token_ids,
            pad_token_id=chat.tokenizer.pad_token_id,
        )
    return chat.decode(out[0, len(prompt) :].tolist())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory):
    """A tiny policy registered the way a training job registers it, from a working directory
    of its own (to see that nothing is written there)."""
    root = tmp_path_factory.mktemp("mlflow-model")
    home, cwd = root / "home", root / "cwd"
    cwd.mkdir()
    saved = {k: os.environ.get(k) for k in ("FLOWRL_HOME", "MLFLOW_TRACKING_URI")}
    os.environ["FLOWRL_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        hf_dir = build_tiny_model(TinyModelSpec(seed=3), str(root / "hf"))
        data = root / "train.jsonl"
        data.write_text(json.dumps({"messages": MESSAGES}) + "\n")
        run_id = tracking.start_run("mlflow-model", "policy-job", {"seed": 3})
        tracking.log_metrics(run_id, {"eval/accuracy": 0.25}, step=40)  # as a job's final eval
        lineage = tracking.Lineage(
            job="policy-job",
            kind="sft-train",
            base_model="models:/base/4",
            data=[
                tracking.DataFile(str(data), hashlib.sha256(data.read_bytes()).hexdigest(), "train")
            ],
            config={"name": "policy-job", "seed": 3},
        )
        model_dir = save_chat_model(hf_dir, str(root / "pyfunc"), MESSAGES)
        uri = tracking.register_policy(
            run_id, hf_dir, model_dir, "chat-policy", {"eval/accuracy": 0.25}, lineage
        )
        tracking.end_run(run_id)
        os.environ["MLFLOW_TRACKING_URI"] = get_settings().tracking_uri  # for mlflow.* calls
        yield {"uri": uri, "hf_dir": hf_dir, "run_id": run_id, "data": data, "cwd": cwd}
    finally:
        os.chdir(previous)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_pyfunc_load_model_generates_what_the_hf_model_generates(registered):
    import mlflow.pyfunc

    assert registered["uri"] == "models:/chat-policy/1"
    model = mlflow.pyfunc.load_model(registered["uri"])
    rows = pd.DataFrame({"messages": [MESSAGES, [{"role": "user", "content": "Hi"}]]})
    out = model.predict(rows, params={"max_new_tokens": 12})
    expected = [greedy_reply(registered["hf_dir"], m, 12) for m in rows["messages"]]
    assert list(out["content"]) == expected
    assert all(isinstance(reply, str) for reply in expected)
    signature = model.metadata.signature
    assert signature.inputs.input_names() == ["messages"]
    assert signature.outputs.input_names() == ["content"]
    assert {p.name for p in signature.params} == {"max_new_tokens", "temperature"}
    assert model.metadata.saved_input_example_info is not None
    with pytest.raises(Exception, match="max_new_tokens"):
        model.predict(rows, params={"max_new_tokens": 0})


def test_the_hf_folder_still_loads_from_the_registry_and_the_run(registered, tmp_path):
    original = load_causal_lm(registered["hf_dir"])
    probe = torch.tensor([[1, 2, 3, 4]])
    for uri in (registered["uri"], f"runs:/{registered['run_id']}/policy"):
        folder = resolve_model_uri(uri, str(tmp_path / "cache"))
        assert (Path(folder) / "config.json").is_file(), uri
        with torch.no_grad():
            assert torch.equal(load_causal_lm(folder)(probe).logits, original(probe).logits), uri


def test_the_version_carries_description_metrics_and_lineage(registered):
    c = tracking.client()
    version = c.get_model_version("chat-policy", "1")
    assert "models:/base/4" in version.description
    assert "policy-job" in version.description
    assert version.tags["flowrl.base_model"] == "models:/base/4"
    assert version.tags["eval.accuracy"] == "0.2500"
    digest = hashlib.sha256(registered["data"].read_bytes()).hexdigest()
    assert version.tags["flowrl.data.0"] == f"train {registered['data']} sha256:{digest}"
    assert version.source.startswith("models:/m-")  # the version is the run's logged model
    logged = c.get_logged_model(version.source.removeprefix("models:/"))
    assert logged.source_run_id == registered["run_id"]
    assert {m.key: m.value for m in logged.metrics} == {"eval/accuracy": 0.25}
    history = c.get_metric_history(registered["run_id"], "eval/accuracy")
    assert [(m.step, m.value) for m in history] == [(40, 0.25)]  # linked, not logged twice
    assert logged.params["name"] == "policy-job"
    inputs = c.get_run(registered["run_id"]).inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("train.jsonl", digest[:16])]
    assert {t.key: t.value for t in inputs[0].tags}["mlflow.data.context"] == "train"


def test_no_mlruns_folder_in_the_working_directory(registered):
    assert not (registered["cwd"] / "mlruns").exists()
    assert list(registered["cwd"].iterdir()) == []


def test_mlflow_models_serve_answers_one_request_on_loopback(registered, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    bin_dir = Path(sys.executable).parent  # as in an activated venv: serve runs `uvicorn`
    cmd = [
        str(bin_dir / "mlflow"),
        "models",
        "serve",
        "-m",
        registered["uri"],
        "--env-manager",
        "local",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
    ]
    with open(log, "wb") as out:
        server = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=tmp_path,
            env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
        )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/ping", timeout=120, process=server)
        body = {"dataframe_records": [{"messages": MESSAGES}], "params": {"max_new_tokens": 12}}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    expected = greedy_reply(registered["hf_dir"], MESSAGES, 12)
    assert answer == {"predictions": [{"content": expected}]}, log.read_text()[-2000:]
