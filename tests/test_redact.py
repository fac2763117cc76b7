"""Secrets stay out of records: URL user-info and secret-named values read ``***``, and every
other config field is recorded as an MLflow param (none dropped for a word in its name)."""

from __future__ import annotations

from flowrl.infra.redact import is_secret_key, redact, redact_text
from flowrl.infra.tracking import Lineage, flatten
from flowrl.tasks.schemas import RLJobConfig


def leaf_fields(model: type, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            out |= leaf_fields(sub, f"{prefix}{name}.")
        else:
            out.add(f"{prefix}{name}")
    return out


def test_the_params_are_every_config_field():
    params = flatten(RLJobConfig().model_dump(mode="json"))
    expected = leaf_fields(RLJobConfig)
    params_top = {k for k in params if not k.startswith("env.params.")}
    assert expected - {"env.params"} <= params_top
    assert "rollout.max_new_tokens" in params and "rollout.max_context_tokens" in params


def test_url_user_info_and_secret_values_are_redacted():
    assert redact_text("http://alice:s3cr3t@127.0.0.1:8765/x") == "http://***@127.0.0.1:8765/x"
    assert redact_text("see s3://key:pw@bucket/m and https://h/p@q") == (
        "see s3://***@bucket/m and https://h/p@q"
    )
    config = {
        "env": {
            "service_url": "http://alice:s3cr3t@127.0.0.1:1",
            "params": {"api_token": "s3cr3t", "max_tokens": 5, "db_password": "s3cr3t"},
        },
        "model": {"source": "https://user:s3cr3t@example.org/model"},
    }
    flat = flatten(config)
    assert "s3cr3t" not in repr(flat) and "s3cr3t" not in repr(redact(config))
    assert flat["env.params.api_token"] == "***" and flat["env.params.max_tokens"] == "5"
    assert flat["env.service_url"] == "http://***@127.0.0.1:1"
    lineage = Lineage(job="j", kind="rl-train", base_model="s3://k:s3cr3t@b/m", config=config)
    assert "s3cr3t" not in repr(lineage.tags())


def test_secret_names_are_whole_words():
    for key in ("password", "api_token", "AWS_SECRET_ACCESS_KEY", "apiKey", "auth_header"):
        assert is_secret_key(key), key
    for key in (
        "max_new_tokens",
        "max_context_tokens",
        "tokenizer",
        "keyboard",
        "monkey",
        "author",
    ):
        assert not is_secret_key(key), key
