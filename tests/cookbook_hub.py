"""Fill a Hugging Face home the way a machine that once loaded from the Hub has it, for the
cookbook's recipes to run unmodified offline (``HF_HUB_OFFLINE=1``).

Run with the thin client venv's Python (its ``datasets`` writes the cache its ``datasets``
reads). Reads one JSON job on stdin::

    {"home": HF_HOME,
     "models": {"Qwen/Qwen3-8B": "/folder/of/a/tiny/fixture", ...},
     "datasets": [{"repo": "openai/gsm8k", "config": "main",
                   "splits": {"train": [row, ...], "test": [row, ...]},
                   "features": {"image": "image", "label": {"names": [...]}}}, ...]}

- a model becomes a Hub snapshot (``hub/models--<org>--<name>/snapshots/<sha>``, ``refs/main``)
  of the fixture's tokenizer and config files, which ``AutoTokenizer.from_pretrained(name)``
  reads offline; no weights (the recipes tokenize here and train on the service);
- a dataset becomes a prepared ``datasets`` cache entry
  (``datasets/<org>___<name>/<config>/0.0.0/<hash>``), which ``load_dataset(name, config)``
  falls back to offline.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

COMMIT = "0" * 40
TOKENIZER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "preprocessor_config.json",
    "processor_config.json",
)


def put_model(home: Path, repo: str, folder: str) -> None:
    """The fixture's tokenizer and config as the Hub cache's snapshot of ``repo``."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(folder) / name).exists():
            shutil.copyfile(Path(folder) / name, snapshot / name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)


def put_dataset(
    repo: str,
    config: str,
    splits: dict[str, list[dict[str, Any]]],
    features: dict[str, Any] | None = None,
) -> None:
    """The rows as ``datasets``' prepared cache of ``repo`` / ``config``. ``features`` types
    columns: ``"image"`` (the rows hold base64 PNG/JPEG), or ``{"names": [...]}`` (a class
    label, the rows hold its index); other columns are inferred."""
    import base64

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.data_files import DataFilesDict
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    typed = None
    if features:
        kinds = {
            column: datasets.Image()
            if kind == "image"
            else datasets.ClassLabel(names=kind["names"])
            for column, kind in features.items()
        }
        images = [column for column, kind in features.items() if kind == "image"]
        for rows in splits.values():
            for row in rows:
                for column in images:
                    row[column] = {"bytes": base64.b64decode(row[column]), "path": None}
        typed = datasets.Features(kinds)
    namespace, name = repo.split("/")
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, rows in splits.items():
            path = os.path.join(tmp, f"{split}.parquet")
            table = pa.Table.from_pylist(rows)
            if typed is not None:
                table = table.cast(typed.arrow_schema)
            pq.write_table(table, path)
            files[split] = [path]
        builder = Parquet(
            cache_dir=os.path.join(tmp, "cache"),
            data_files=DataFilesDict.from_patterns(files, base_path=tmp),
            dataset_name=name,
            config_name=config,
            features=typed,
        )
        builder.download_and_prepare()
        cache = Path(datasets.config.HF_DATASETS_CACHE)
        folder = f"{namespace}___{camelcase_to_snakecase(name)}"  # as datasets names it
        dest = cache / folder / config / "0.0.0" / ("0" * 16)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(builder.cache_dir, dest)


def main() -> None:
    job = json.load(sys.stdin)
    home = Path(job["home"])
    os.environ["HF_HOME"] = str(home)  # before datasets reads its config
    for repo, folder in job.get("models", {}).items():
        put_model(home, repo, folder)
    for entry in job.get("datasets", []):
        config = entry.get("config", "default")
        put_dataset(entry["repo"], config, entry["splits"], entry.get("features"))


if __name__ == "__main__":
    main()
