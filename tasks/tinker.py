"""A Tinker API checkpoint as an MLflow Model version, like every other trained policy.

``register_checkpoint("tinker://<run>/sampler_weights/<name>", "my-policy")`` (also
``flowrl tinker register``): the checkpoint of the namespace in ``FLOWRL_NAMESPACE`` (the one
its API key maps to) is merged into its base model (LoRA folded in), written as an HF folder and
an MLflow pyfunc model, and registered with lineage (tinker path, training run, base model) in
an MLflow run of the ``tinker`` experiment; ``mlflow.pyfunc.load_model("models:/...")`` serves it
as any version.
"""

from __future__ import annotations

import tempfile

from flowrl.backends.models.mlflow_model import save_chat_model
from flowrl.backends.models.model_folder import copy_model_files
from flowrl.backends.models.tinker_checkpoints import checkpoint_folder, resolve_base_model
from flowrl.infra import tracking
from flowrl.infra.settings import get_settings, scoped_model_name
from flowrl.infra.storage import Storage

EXAMPLE = [{"role": "user", "content": "What is 2+3?"}]


def _merged(peft_model):  # noqa: ANN001, ANN202 - a PEFT model in, a transformers model out
    """The adapter folded into the base weights. A tied output layer (tiny models tie it to the
    input embeddings) is untied first: folding an ``lm_head`` adapter into a tied weight would
    change the input embeddings too."""
    import torch

    base = peft_model.get_base_model()
    head = base.get_output_embeddings()
    inner = getattr(head, "base_layer", head)
    if inner.weight is base.get_input_embeddings().weight:
        inner.weight = torch.nn.Parameter(inner.weight.detach().clone())
    base.config.tie_word_embeddings = False
    return peft_model.merge_and_unload()


def register_checkpoint(path: str, name: str, experiment: str = "tinker") -> str:
    """Register the checkpoint at ``path`` as a new version of ``name`` (in the namespace's
    scope); returns ``models:/<name>/<version>``."""
    from flowrl.backends.engines.tinker.model import TinkerModel
    from flowrl.backends.engines.tinker.types import read_tinker_lora

    settings = get_settings()
    namespace = settings.namespace
    storage = Storage(settings.storage_root)
    run_id, kind, folder = checkpoint_folder(storage, namespace, path)
    record = storage.read_json(f"{folder}/checkpoint.json")
    base_name = record["base_model"]
    if base_name not in settings.tinker_models:
        raise ValueError(f"{path}: base model {base_name!r} is not in the catalogue")
    base_uri = settings.tinker_models[base_name]
    base_dir = resolve_base_model(base_uri, settings.model_cache_dir)
    model = TinkerModel(base_dir, *read_tinker_lora(record["lora"]))
    model.load_state_bytes(
        {"adapter.safetensors": storage.read_bytes(f"{folder}/adapter.safetensors")}, False
    )
    merged = _merged(model.model)
    lineage = tracking.Lineage(
        job=run_id,
        kind="tinker",
        base_model=base_uri,
        config={"tinker_path": path, "base_model": base_name, "lora": record["lora"], "kind": kind},
    )
    run = tracking.start_run(experiment, f"register-{run_id}", lineage.config, None, namespace)
    try:
        tracking.set_tags(run, {"flowrl.tinker_path": path, "flowrl.tinker_run": run_id})
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir, model_dir = f"{tmp}/hf", f"{tmp}/mlflow-model"
            merged.save_pretrained(hf_dir)
            copy_model_files(base_dir, hf_dir)  # tokenizer, chat template, generation config
            save_chat_model(hf_dir, model_dir, EXAMPLE)
            uri = tracking.register_policy(
                run, hf_dir, model_dir, scoped_model_name(name, namespace), {}, lineage
            )
    except BaseException:
        tracking.end_run(run, status="FAILED")
        raise
    tracking.end_run(run)
    return uri
