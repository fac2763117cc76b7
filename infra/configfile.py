"""Reading job configs: YAML files, ``--set key=value`` overrides, validation errors that name
every bad field. Schema-free: the job schemas themselves live in ``flowrl.tasks.schemas``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

Config = TypeVar("Config", bound=BaseModel)

STRICT_MODEL_CONFIG = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
"""The ``model_config`` of flowrl's settings models (job sections, environment parameters,
worker specs): immutable, unknown keys refused, no ``inf`` or ``nan`` in a float field."""


class ConfigError(ValueError):
    """A job config that cannot run; the message names every bad field."""


def format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(config)"
        lines.append(f"  {where}: {e['msg']}")
    return "invalid job config:\n" + "\n".join(lines)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["a.b=3", "c=x"]`` → nested dict; values are parsed as YAML scalars/lists."""
    data: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected key=value")
        _set_dotted(data, key.strip(), parse_yaml(raw, f"--set {key.strip()}"))
    return data


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, section by section (a nested dict merges, anything else wins)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def shipped_configs() -> dict[str, Path]:
    """The example job configs that come with flowrl (``flowrl.configs``), by name."""
    from importlib.resources import files

    folder = Path(str(files("flowrl.configs")))
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def resolve_config_path(path: str | Path) -> Path:
    """A config file: ``path`` if it is a file, else a shipped config of that name
    (``arithmetic``, ``gomoku-selfplay`` ...); ``ConfigError`` listing the names otherwise."""
    p = Path(path)
    if p.is_file():
        return p
    shipped = shipped_configs()
    name = str(path).removesuffix(".yaml")
    if "/" not in name and name in shipped:
        return shipped[name]
    raise ConfigError(
        f"config file not found: {p} (nor a config shipped with flowrl: {', '.join(shipped)})"
    )


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping (plain YAML lets the
    last one silently win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, list | dict):
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a scalar", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    f"key {key!r} first written on line {seen[key] + 1}",
                    None,
                    f"duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, where: str) -> Any:
    """YAML text (safe tags only, no duplicate keys); ``ConfigError`` naming ``where`` and the
    line otherwise."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = err.problem or err.context or "not valid YAML"
        raise ConfigError(f"{where}:{line}: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {err}") from None


def read_mapping(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A YAML file's top-level mapping (``{}`` for no file) with ``--set`` overrides applied."""
    data: dict[str, Any] = {}
    if path is not None:
        p = resolve_config_path(path)
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw[: err.start].count(b"\n") + 1
            raise ConfigError(f"{p}: line {line}: not UTF-8 (byte {err.start})") from None
        loaded = parse_yaml(text, str(p)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
        data = loaded
    return merge(data, parse_overrides(overrides or []))


def validate_config(data: dict[str, Any], kind: type[Config]) -> Config:
    """``data`` as a ``kind``; a ``ConfigError`` naming every bad field otherwise."""
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None, kind: type[Config]) -> Config:
    """Read a YAML job config (or the embedded defaults when ``path`` is None), apply
    overrides, validate as ``kind`` (a job schema of ``flowrl.tasks.schemas``)."""
    return validate_config(read_mapping(path, overrides), kind)
