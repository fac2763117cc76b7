"""The policy's chat format for a job: tokenizer and template from a model URI, as the job's
``model`` section asks, cached per process."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from flowrl.backends.chat import HFChatFormat, probe
from flowrl.backends.model_uri import resolve_model_uri

if TYPE_CHECKING:  # annotation only: the schemas import nothing from here
    from flowrl.tasks.schemas import ModelSection


def chat_format(model_uri: str, cache_dir: str, model: ModelSection) -> HFChatFormat:
    """The policy's chat format as the job's ``model`` section asks (its ``chat_format`` and
    ``tool_messages``): tokenizer, template, generation config and processor settings only
    (tasks never load weights), checked by ``probe`` the first time a job asks for it (on what
    the template accepts; ``prepare_model`` probes what the environment sends). Control tokens
    inside environment text stay text."""
    return _chat_format(model_uri, cache_dir, model.chat_format, model.tool_messages)


@lru_cache(maxsize=8)
def _chat_format(model_uri: str, cache_dir: str, name: str, tool_messages: str) -> HFChatFormat:
    folder = resolve_model_uri(model_uri, cache_dir)
    chat = HFChatFormat.from_folder(folder, chat_format=name, tool_messages=tool_messages)
    probe(chat)
    return chat
