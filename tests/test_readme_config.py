"""The config tables of docs/configuration.md (the README's docs map links it) are exactly
what docs/config_tables.py renders from the job schemas."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from flowrl.tasks.schemas import RLJobConfig, SelfPlayJobConfig

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "docs" / "config_tables.py"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("flowrl_docs_config_tables", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return _load_generator()


def test_readme_block_equals_generated_output(gen: ModuleType) -> None:
    guide = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    block = gen.read_block(guide)
    assert block == gen.render(), (
        "docs/configuration.md's config tables are stale: python docs/config_tables.py --write"
    )


def test_tables_carry_the_schema_defaults(gen: ModuleType) -> None:
    block = gen.render()
    rl = RLJobConfig()
    row = f"| `rollout.prompts_per_step` | `int` | `{rl.rollout.prompts_per_step}` |"
    assert row in block
    assert f"| `schedule.steps` | `int` | `{rl.schedule.steps}` |" in block
    assert f"`{rl.algorithm.learning_rate!r}`" in block  # 0.0003, not 3e-4
    assert "| `algorithm.clip_eps_high` | `float \\| None` | `null` |" in block
    assert f'| `model.source` | `str` | `"{rl.model.source}"` |' in block
    # a default_factory evaluated (self-play's tic-tac-toe env), a required field marked
    selfplay_env = SelfPlayJobConfig.model_fields["env"].get_default(call_default_factory=True)
    assert f'| `env.name` | `str` | `"{selfplay_env.name}"` |' in block
    assert "| `data.train` | `str` | *required* |" in block
    # every job kind has its section, in a deterministic order
    kinds = ["rl-train", "self-play", "sft-train", "batch-inference", "retrain"]
    positions = [block.index(f"### `{k}`:") for k in kinds]
    assert positions == sorted(positions)
    assert gen.render() == block


def test_check_and_write(
    gen: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{gen.BEGIN}\n| stale | table |\n{gen.END}\noutro\n")
    assert gen.main(["--check", "--readme", str(readme)]) == 1
    assert "-| stale | table |" in capsys.readouterr().out
    assert gen.main(["--write", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"intro\n{gen.BEGIN}\n") and text.endswith(f"{gen.END}\noutro\n")
    assert gen.main(["--check", "--readme", str(readme)]) == 0
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="config-tables:begin"):
        gen.main(["--check", "--readme", str(readme)])
