"""The policy's chat format for a job: tokenizer and template from a model URI, as the job's
``model`` section asks, cached per process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.backends.models.chat import ChatSource, HFChatFormat, chat_format_of

if TYPE_CHECKING:  # annotation only: the schemas import nothing from here
    from flowrl.tasks.schemas import ModelSection


def chat_format(model_uri: str, cache_dir: str, model: ModelSection) -> HFChatFormat:
    """The policy's chat format as the job's ``model`` section asks (its ``chat_format`` and
    ``tool_messages``; ``backends.models.chat.chat_format_of``): tasks never load weights; the
    template is probed on what it accepts the first time a process asks for it
    (``prepare_model`` probes what the environment sends)."""
    return chat_format_of(ChatSource(model_uri, cache_dir, model.chat_format, model.tool_messages))
