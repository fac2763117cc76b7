"""The config tables of docs/configuration.md, generated from the job schemas in
``flowrl.tasks.schemas``.

Every job kind gets a markdown section: per config section a table
``| field | type | default | description |`` with dotted field names and the defaults a job gets
(``default_factory`` evaluated, YAML-style scalars). ``rl-train`` is rendered in full; the other
kinds show only the top-level fields and sections that differ from ``rl-train``'s.

    python docs/config_tables.py           # print the block
    python docs/config_tables.py --check   # exit 1 with a diff if the guide's block is stale
    python docs/config_tables.py --write   # rewrite the guide's block in place
"""

from __future__ import annotations

import inspect
import math
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling generated_block.py
from generated_block import Block  # noqa: E402

from flowrl.tasks.schemas import JOB_KINDS, RetrainConfig, RLJobConfig

CONFIG_DOC = Path(__file__).resolve().parent / "configuration.md"
BEGIN = "<!-- config-tables:begin -->"
END = "<!-- config-tables:end -->"
REFERENCE_KIND = "rl-train"
REQUIRED = "*required*"


@dataclass(frozen=True)
class Row:
    """One field of a table: dotted name, type, default (markdown) and description."""

    name: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Table:
    """One config section: its dotted path ("" for the top level), schema and scalar fields."""

    path: str
    schema: str
    description: str
    rows: tuple[Row, ...]


# ------------------------------------------------------------------------------ formatting


def format_type(annotation: Any) -> str:
    """A field's annotation as written in the schema: ``int``, ``str | None``, ``Literal[...]``."""
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # a constrained type (e.g. RowFile): show the base type
        return format_type(args[0])
    if origin is typing.Literal:
        return "Literal[" + ", ".join(format_value(a) for a in args) + "]"
    if origin in (types.UnionType, typing.Union):
        return " | ".join(format_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[" + ", ".join(format_type(a) for a in args) + "]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _format_float(x: float) -> str:
    if math.isnan(x):
        return ".nan"
    if math.isinf(x):
        return ".inf" if x > 0 else "-.inf"
    text = repr(x)
    mantissa, e, exponent = text.partition("e")
    if e and "." not in mantissa:  # 1e-05 is a string to YAML 1.1; 1.0e-05 is a float
        text = f"{mantissa}.0e{exponent}"
    return text


def format_value(value: Any) -> str:
    """A default as YAML reads it: ``64``, ``0.0003``, ``null``, ``true``, ``"tiny"``, ``[…]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _format_float(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, BaseModel):
        return format_value(value.model_dump())
    if isinstance(value, dict):
        items = (f"{format_mapping_key(k)}: {format_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list | tuple | set | frozenset):
        ordered = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return "[" + ", ".join(format_value(v) for v in ordered) + "]"
    return format_value(str(value))


def format_mapping_key(key: Any) -> str:
    """A mapping key, bare when YAML reads it back as the same string."""
    text = str(key)
    if text.replace("_", "").replace("-", "").isalnum() and not text[0].isdigit():
        return text
    return format_value(text)


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _doc(cls: type) -> str:
    """First paragraph of a class docstring, on one line."""
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


# ------------------------------------------------------------------------------ collecting


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def collect_tables(
    schema: type[BaseModel],
    values: BaseModel | None = None,
    path: str = "",
    description: str = "",
) -> list[Table]:
    """``schema``'s tables, depth first in field order: its own scalar fields, then each nested
    section. Defaults come from ``values`` (the parent's default for this section) when given,
    else from the fields' own defaults (factories called)."""
    rows: list[Row] = []
    nested: list[Table] = []
    prefix = f"{path}." if path else ""
    for name, field in schema.model_fields.items():
        if values is not None:
            value: Any = getattr(values, name)
        elif field.is_required():
            value = PydanticUndefined
        else:
            value = field.get_default(call_default_factory=True)
        annotation = field.annotation
        if _is_section(annotation):
            sub_values = value if isinstance(value, BaseModel) else None
            nested += collect_tables(annotation, sub_values, prefix + name, field.description or "")
            continue
        default = REQUIRED if value is PydanticUndefined else _code(_cell(format_value(value)))
        rows.append(
            Row(
                name=_code(prefix + name),
                type=_code(_cell(format_type(annotation))),
                default=default,
                description=_cell(field.description or ""),
            )
        )
    return [Table(path, schema.__name__, description, tuple(rows)), *nested]


# ------------------------------------------------------------------------------ rendering


def render_table(table: Table, top_level: bool = False) -> list[str]:
    """Markdown lines of one table, with its heading line."""
    if top_level:
        heading = f"Top level (`{table.schema}`):"
    else:
        about = f": {_cell(table.description)}" if table.description else ""
        heading = f"**`{table.path}`** (`{table.schema}`){about}"
    lines = [heading, "", "| field | type | default | description |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.type} | {r.default} | {r.description} |" for r in table.rows]
    return [*lines, ""]


def _relative(name: str, prefix: str) -> str:
    """A dotted name relative to ``prefix`` ("" = the name itself)."""
    if not prefix:
        return name
    return "" if name == prefix else name.removeprefix(prefix + ".")


def _key(table: Table, prefix: str) -> tuple[str, tuple[Row, ...]]:
    """A table as compared with the reference's: path and row names relative to ``prefix``,
    values included."""
    rows = tuple(
        Row(_code(_relative(r.name.strip("`"), prefix)), r.type, r.default, r.description)
        for r in table.rows
    )
    return _relative(table.path, prefix), rows


def _names(items: Sequence[str]) -> str:
    return ", ".join(f"`{i}`" for i in items)


def render_kind(
    flow: str, schema: type[BaseModel], reference: tuple[type[BaseModel], list[Table]] | None
) -> list[str]:
    """One job kind's section; with ``reference`` (rl-train's schema and tables) only the
    top-level fields and the sections that differ from it."""
    lines = [f"### `{flow}`: `{schema.__name__}`", ""]
    doc = _doc(schema)
    if doc:
        lines += [doc, ""]
    tables = collect_tables(schema)
    if reference is None:
        for table in tables:
            if table.rows:
                lines += render_table(table, top_level=not table.path)
        return lines

    ref_schema, ref_tables = reference
    ref_by_path = {t.path: t for t in ref_tables}
    # A field holding a whole reference job (retrain's `job`) is compared with the reference.
    embedded = [n for n, f in schema.model_fields.items() if f.annotation is ref_schema]
    same_fields: list[str] = []
    same_sections: list[str] = []
    covered: set[str] = set()
    for table in tables:
        if not table.path:  # this kind's own top level: only fields new or changed
            ref_rows = {r.name: r for r in ref_by_path[""].rows}
            own = tuple(r for r in table.rows if ref_rows.get(r.name) != r)
            same_fields += [r.name.strip("`") for r in table.rows if r not in own]
            if own:
                lines += render_table(Table("", table.schema, "", own), top_level=True)
            covered.add("")
            continue
        prefix = next(
            (e for e in embedded if table.path == e or table.path.startswith(e + ".")), ""
        )
        path, rows = _key(table, prefix)
        covered.add(path)
        ref = ref_by_path.get(path)
        if ref is not None and _key(ref, "") == (path, rows):
            same_sections.append(table.path)
        elif table.rows:
            lines += render_table(table)
    own_names = {r.name.strip("`") for r in tables[0].rows}
    missing = (
        []
        if embedded
        else [r.name.strip("`") for r in ref_by_path[""].rows if r.name.strip("`") not in own_names]
    )
    missing += [t.path for t in ref_tables if t.path and t.path not in covered]
    same = [f"fields {_names(same_fields)}"] if same_fields else []
    same += [f"sections {_names(same_sections)}"] if same_sections else []
    notes = [f"As in `{REFERENCE_KIND}`, not repeated: {'; '.join(same)}."] if same else []
    notes += [f"Not in this kind: {_names(missing)}."] if missing else []
    if notes:
        lines += [" ".join(notes), ""]
    return lines


def job_kinds() -> list[tuple[str, type[BaseModel]]]:
    """(flow name, schema) of every job kind, in ``JOB_KINDS`` order, then ``retrain``."""
    kinds: list[tuple[str, type[BaseModel]]] = list(JOB_KINDS.items())
    if all(schema is not RetrainConfig for _, schema in kinds):
        kinds.append(("retrain", RetrainConfig))
    return kinds


def render() -> str:
    """The block between the markers (markers excluded), ending with a newline."""
    lines = [
        "<!-- Generated by `python docs/config_tables.py --write` from the schemas in "
        "`tasks/schemas.py`; do not edit by hand. -->",
        "",
        "Every job kind's config, from its pydantic schema in `tasks/schemas.py`"
        " (`flowrl.tasks.schemas`). Nested sections are tables of their own; fields are named by"
        f" dotted path, as in `--set` overrides. `{REFERENCE_KIND}` is listed in full; every"
        " other kind lists only its top-level fields and sections that differ from"
        f" `{REFERENCE_KIND}`'s (a section is shown whole when any of its fields or defaults"
        f" differ). Defaults are written as YAML reads them; a {REQUIRED} field has no default.",
        "",
    ]
    reference = (RLJobConfig, collect_tables(RLJobConfig))
    lines += render_kind(REFERENCE_KIND, RLJobConfig, None)
    for flow, schema in job_kinds():
        if flow != REFERENCE_KIND:
            lines += render_kind(flow, schema, reference)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------- the guide's block

BLOCK = Block(BEGIN, END, "config tables")
read_block = BLOCK.read
replace_block = BLOCK.replace


def main(argv: Sequence[str] | None = None) -> int:
    """Print the block, check the guide's against it (``--check``) or rewrite it (``--write``)."""
    description = __doc__.split("\n\n", 1)[0]
    return BLOCK.main(argv, render, CONFIG_DOC, description, ("--doc", "--readme"))


if __name__ == "__main__":
    sys.exit(main())
