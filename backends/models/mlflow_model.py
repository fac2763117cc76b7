"""A trained policy as an MLflow Model: the HF folder inside a ``python_function`` model.

A registered version is then what an MLflow user expects: ``mlflow.pyfunc.load_model`` loads
it, ``predict`` takes chat messages and returns the assistant's reply, ``mlflow models serve``
answers ``/invocations``. The HF folder travels unchanged as the model's ``policy`` artifact
(``<model>/artifacts/policy``), which is what ``resolve_model_uri`` hands to the loaders.

Request shape (one row per conversation)::

    {"dataframe_records": [{"messages": [{"role": "user", "content": "What is 2+3?"}]}],
     "params": {"max_new_tokens": 32}}
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types.schema import Array, ColSpec, Object, ParamSchema, ParamSpec, Property, Schema

POLICY_ARTIFACT = "policy"
DEFAULT_MAX_NEW_TOKENS = 64

SIGNATURE = ModelSignature(
    inputs=Schema(
        [
            ColSpec(
                Array(Object([Property("role", "string"), Property("content", "string")])),
                name="messages",
            )
        ]
    ),
    outputs=Schema([ColSpec("string", name="content")]),
    params=ParamSchema(
        [
            ParamSpec("max_new_tokens", "long", DEFAULT_MAX_NEW_TOKENS),
            ParamSpec("temperature", "double", 0.0),
        ]
    ),
)


class ChatPolicy(mlflow.pyfunc.PythonModel):
    """Chat messages in, the assistant's next message out (greedy unless ``temperature`` > 0).

    Each row's ``messages`` is a list of ``{"role", "content"}``; roles are the model's chat
    roles (system, user, assistant, tool). Control tokens inside message text are encoded as
    plain text, as in training.
    """

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        from flowrl.backends.models.chat import HFChatFormat
        from flowrl.backends.models.model_folder import load_causal_lm, pad_id

        path = context.artifacts[POLICY_ARTIFACT]
        self._chat = HFChatFormat.from_folder(path)
        self._pad = pad_id(self._chat.tokenizer)
        self._model = load_causal_lm(path)

    def predict(
        self,
        context: mlflow.pyfunc.PythonModelContext,
        model_input: pd.DataFrame,
        params: dict[str, Any] | None = None,
    ) -> pd.DataFrame:
        import torch

        params = params or {}
        max_new_tokens = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        temperature = float(params.get("temperature", 0.0))
        if not 1 <= max_new_tokens <= 4096:
            raise ValueError(f"max_new_tokens={max_new_tokens}: expected 1..4096")
        replies = []
        for row, messages in enumerate(model_input["messages"]):
            prompt = self._chat.encode_prompt(_messages(messages, row))
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self._model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=temperature > 0,
                    temperature=temperature if temperature > 0 else None,
                    top_k=None,
                    top_p=None,
                    eos_token_id=self._chat.stop_token_ids,
                    pad_token_id=self._pad,
                )
            replies.append(self._chat.decode(out[0, len(prompt) :].tolist()))
        return pd.DataFrame({"content": replies})


def _messages(cell: Any, row: int) -> list[dict[str, str]]:
    """A row's messages as plain dicts (schema enforcement may hand over arrays of dicts)."""
    messages = list(cell) if cell is not None else []
    if not messages:
        raise ValueError(f"row {row}: 'messages' is empty")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"row {row}: each message needs a 'role' and a text 'content'")
        out.append({"role": str(m.get("role")), "content": m["content"]})
    return out


def requirements() -> list[str]:
    """What the model needs at load time: flowrl and the model stack, at the versions that
    logged it (given explicitly, so MLflow does not load the model to infer them)."""
    names = ("flowrl", "torch", "transformers", "tokenizers", "pandas", "mlflow")
    return [f"{n}=={importlib.metadata.version(n)}" for n in names]


def save_chat_model(hf_dir: str, out_dir: str, example: list[dict[str, str]]) -> str:
    """Write the MLflow Model (pyfunc, signature, input example) for the HF folder ``hf_dir``
    into ``out_dir``; returns ``out_dir``."""
    mlflow.pyfunc.save_model(
        path=out_dir,
        python_model=ChatPolicy(),
        artifacts={POLICY_ARTIFACT: str(Path(hf_dir))},
        signature=SIGNATURE,
        input_example=(pd.DataFrame({"messages": [example]}), {"max_new_tokens": 16}),
        pip_requirements=requirements(),
    )
    return out_dir
