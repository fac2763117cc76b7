"""The README is an entry point: short, with what a new user needs first on its first screen,
and every guide it links exists; docs/architecture.md's module graph is the code's own."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FIRST_SCREEN = 60  # lines


def _load(script: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"flowrl_docs_{script}", REPO / "docs" / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _links(path: Path) -> list[str]:
    """Relative link targets of a markdown file (images too), without anchors."""
    text = path.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    paths = [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t)]
    return [p for p in paths if p]


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the file's headings."""
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_readme_is_an_entry_point_of_at_most_300_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, len(lines)
    first = "\n".join(lines[:FIRST_SCREEN])
    for what in ("make demo", "make test", "held-out accuracy at the end", "registered model"):
        assert what in first, f"{what!r} is not on the README's first screen"
    for anchor in ("#quickstart", "#train-your-own-environment", "#documentation"):
        assert f"]({anchor})" in first, f"no link to {anchor} on the README's first screen"


def test_every_link_of_the_readme_and_the_guides_exists() -> None:
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    missing = [
        f"{page.relative_to(REPO)} → {target}"
        for page in pages
        for target in _links(page)
        if not (page.parent / target).exists()
    ]
    assert not missing, missing
    readme_anchors = _anchors(README)
    text = README.read_text(encoding="utf-8")
    dangling = [a for a in re.findall(r"\]\(#([^)]+)\)", text) if a not in readme_anchors]
    assert not dangling, dangling


def test_the_docs_map_links_every_guide() -> None:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Documentation", 1)[1]
    linked = {Path(t).name for t in _links(README) if t.startswith("docs/") and t in section}
    guides = {p.name for p in (REPO / "docs").glob("*.md")}
    assert guides <= linked, sorted(guides - linked)


@pytest.fixture(scope="module")
def graph() -> ModuleType:
    return _load("module_graph.py")


def test_architecture_module_graph_is_current(graph: ModuleType) -> None:
    guide = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert graph.read_block(guide) == graph.render(), (
        "docs/architecture.md's module graph is stale: python docs/module_graph.py --write"
    )


def test_module_graph_follows_flowrl_imports_back_to_their_folders(graph: ModuleType) -> None:
    edges = graph.graph()
    # flows/rl.py imports flowrl.tasks.rl and flowrl.flows.lifecycle: both are arrows
    assert {"flowrl.tasks.rl", "flowrl.flows.lifecycle"} <= edges["flowrl.flows.rl"]
    # every module of every folder is a node, subpackages included
    files = graph.modules()
    on_disk = {p for layer in graph.LAYERS[1:] for p in (REPO / layer).rglob("*.py")}
    assert on_disk <= set(files.values())
    # a layer's arrows never point up (the layering rule, as drawn)
    order = {layer: i for i, layer in enumerate(graph.LAYERS)}
    upward = [
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if graph.layer_of(b) != "infra" and order[graph.layer_of(b)] < order[graph.layer_of(a)]
    ]
    assert not upward, upward


TOP_FOLDERS = ("flowrl", "flows", "tasks", "agent_loop", "environments", "backends", "infra")
TOP_FOLDERS += ("configs", "examples", "benchmarks", "tests", "notebooks", "docs")


def test_architecture_names_only_modules_that_exist() -> None:
    """Every module path docs/architecture.md names exists: a path from a top-level folder
    anywhere on the page, and in a row of its layout table, each file or folder the row names
    (``chat.py`` in the ``backends/models/`` row), in the row's folder or below it."""
    guide = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for token in re.findall(r"`([\w./-]+)`", guide):
        if "/" in token and token.split("/")[0] in TOP_FOLDERS and not (REPO / token).exists():
            missing.append(token)
    for row in re.findall(r"^\| `([\w/]+/)`[^\n]*", guide, flags=re.MULTILINE):
        folder = REPO / row
        line = next(x for x in guide.splitlines() if x.startswith(f"| `{row}`"))
        for token in re.findall(r"`([\w/]+(?:\.py|/))`", line.split("|", 3)[2]):
            if token.split("/")[0] in TOP_FOLDERS:
                continue
            if not ((folder / token).exists() or any(folder.rglob(token.rstrip("/")))):
                missing.append(f"{row}{token}")
    assert not missing, missing


def test_architecture_has_a_row_for_every_backends_sub_package() -> None:
    guide = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    subs = [p.name for p in sorted((REPO / "backends").iterdir()) if (p / "__init__.py").exists()]
    assert subs == ["engines", "models", "policy", "services"], subs
    missing = [s for s in subs if f"| `backends/{s}/` |" not in guide]
    assert not missing, missing
