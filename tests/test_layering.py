"""The house's layering, read from the code's own imports (ast), and its one import root.

cli → flows → tasks → backends / agent_loop → environments; infra is used by all and uses none
of them. Prefect tasks are defined only in ``tasks/``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "tasks", "agent_loop", "environments", "backends", "infra")
NEVER = {
    "cli": set(),
    "flows": {"cli"},
    "tasks": {"flows", "cli"},
    "backends": {"tasks", "flows", "cli"},
    "agent_loop": {"prefect", "tasks", "flows", "cli"},
    "environments": {"torch", "backends", "agent_loop", "tasks", "flows", "cli"},
    "infra": {"flows", "tasks", "backends", "agent_loop", "cli"},
}


def _modules() -> dict[str, Path]:
    """Layer name → its files (``cli`` is flowrl/cli.py, cli_parser.py and __main__.py)."""
    files = {p: sorted((REPO / p).rglob("*.py")) for p in PACKAGES}  # subpackages too
    files["cli"] = [REPO / "flowrl" / n for n in ("cli.py", "cli_parser.py", "__main__.py")]
    return files


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every absolute import, lazy ones inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _layer(module: str) -> str:
    """``flowrl.tasks.rl`` → ``tasks``; ``flowrl.cli`` → ``cli``; ``torch.nn`` → ``torch``."""
    parts = module.split(".")
    if parts[0] == "flowrl" and len(parts) > 1:
        return parts[1]
    return parts[0]


def test_no_layer_imports_what_it_must_never_import():
    bad = [
        f"{path.relative_to(REPO)}:{line} ({layer}) imports {module}"
        for layer, paths in _modules().items()
        for path in paths
        for line, module in _imports(path)
        if _layer(module) in NEVER[layer]
    ]
    assert not bad, "\n".join(bad)


BACKENDS_ORDER = ("types", "models", "engines", "policy", "services")
"""``backends/``'s sub-packages, each importing only those before it (docs/architecture.md)."""


def _backends_part(path: Path) -> str | None:
    """``backends/engines/hf_sampler.py`` → ``engines``; ``backends/types.py`` → ``types``;
    None for the package's own ``__init__`` and the compatibility module."""
    parts = path.relative_to(REPO / "backends").parts
    if len(parts) > 1:
        return parts[0]
    return "types" if parts[0] == "types.py" else None


def test_backends_sub_packages_import_only_those_before_them():
    """types ← models ← engines ← policy ← services: a format never starts a worker, an engine
    never knows where it is placed, a placement never imports a service."""
    bad = []
    for path in _modules()["backends"]:
        part = _backends_part(path)
        if part is None:
            continue
        assert part in BACKENDS_ORDER, f"{path.relative_to(REPO)}: a sub-package without a rank"
        for line, module in _imports(path):
            names = module.split(".")
            if names[:2] != ["flowrl", "backends"] or len(names) < 3:
                continue
            if BACKENDS_ORDER.index(names[2]) > BACKENDS_ORDER.index(part):
                bad.append(f"{path.relative_to(REPO)}:{line} ({part}) imports {module}")
    assert not bad, "\n".join(bad)


def test_backends_has_no_flat_modules_but_its_contracts():
    """Every module of ``backends/`` sits in a sub-package by what it is, except the data
    contracts (``types.py``) and the one kept for old MLflow Models (``mlflow_model.py``)."""
    flat = {p.name for p in (REPO / "backends").glob("*.py")}
    assert flat == {"__init__.py", "types.py", "mlflow_model.py"}, sorted(flat)


def test_nothing_in_flowrl_imports_the_deprecated_schema_module():
    """``flowrl.tasks.jobs`` only keeps users' old imports working (it warns): flowrl's own
    code imports the job schemas from ``flowrl.tasks.schemas``."""
    bad = [
        f"{path.relative_to(REPO)}:{line}"
        for paths in _modules().values()
        for path in paths
        for line, module in _imports(path)
        if module == "flowrl.tasks.jobs"
    ]
    assert not bad, bad


CLI_MODULES = ("flowrl.cli", "flowrl.cli_parser", "flowrl.__main__")


def test_nothing_imports_the_cli_and_no_bare_top_level_names():
    """The CLI sits on top; code reaches flowrl only through the ``flowrl.`` root."""
    bad = []
    for layer, paths in _modules().items():
        for path in paths:
            for line, module in _imports(path):
                if module.split(".")[0] in PACKAGES:
                    bad.append(f"{path.relative_to(REPO)}:{line} bare import {module}")
                if layer != "cli" and module in CLI_MODULES:
                    bad.append(f"{path.relative_to(REPO)}:{line} imports the CLI")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_packages():
    edges: dict[str, set[str]] = {layer: set() for layer in NEVER}
    for layer, paths in _modules().items():
        for path in paths:
            for _, module in _imports(path):
                target = _layer(module)
                if module.startswith("flowrl.") and target in edges and target != layer:
                    edges[layer].add(target)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
            for nxt in edges[start]
        )

    cycles = [layer for layer in edges if reaches(layer, layer, {layer})]
    assert not cycles, {layer: sorted(edges[layer]) for layer in cycles}


def test_prefect_tasks_are_defined_only_in_tasks():
    def defines_task(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for deco in node.decorator_list:
                    target = deco.func if isinstance(deco, ast.Call) else deco
                    if isinstance(target, ast.Name) and target.id == "task":
                        return True
        return False

    elsewhere = [
        str(path.relative_to(REPO))
        for layer, paths in _modules().items()
        if layer != "tasks"
        for path in paths
        if defines_task(path)
    ]
    assert not elsewhere, elsewhere


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("flowrl-*.whl")
    return built


def test_the_wheel_installs_one_top_level_name(wheel: Path):
    """``pip install .`` puts ``flowrl`` (and its dist-info) into site-packages, nothing else:
    a user's own ``environments/`` or ``tasks`` package can neither shadow nor be shadowed.
    The package data travels with it: scheduler and deployment declarations, k8s templates,
    the example configs."""
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"flowrl"}, tops
    assert "flowrl/flows/rl.py" in names
    for data in ("infra/scheduler.yaml", "infra/prefect.yaml", "configs/arithmetic.yaml"):
        assert f"flowrl/{data}" in names, data
    assert any(n.startswith("flowrl/infra/k8s/") for n in names)
    shipped = {p.name for p in (REPO / "configs").glob("*.yaml")}
    assert {n.removeprefix("flowrl/configs/") for n in names if n.endswith(".yaml")} >= shipped
    # every module of every folder ships, subpackages too (a new one must be listed in
    # pyproject.toml's packages)
    sources = {
        f"flowrl/{path.relative_to(REPO).as_posix()}"
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
    }
    assert not sources - set(names), sorted(sources - set(names))


@pytest.fixture(scope="module")
def wheel_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv outside the repository with the built wheel ``pip install``ed into it.
    Its dependencies (torch, Prefect, Ray, MLflow ...) are read from this test's environment
    through a ``.pth`` line (no second multi-GB install); that line adds a folder, it runs no
    ``.pth`` inside it, so this checkout's editable install stays out of the venv."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (Path(site) / "zz_flowrl_test_deps.pth").write_text("\n".join(deps) + "\n")
    return venv


def test_the_installed_wheel_runs_infra_up_and_a_job_from_a_user_folder(
    wheel_venv: Path, tmp_path: Path, prefect_api
):
    """Outside the repository, from the wheel: ``flowrl infra up`` applies the packaged
    scheduler and deployment declarations, and ``flowrl train`` runs a shipped config by name
    to a registered model, in a folder with its own ``environments/``, ``tasks/``, ``flows/``
    and ``infra/`` packages (each raises on import) beside a config of the user's."""
    for name in ("environments", "tasks", "flows", "infra"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('the user package')\n")
    (tmp_path / "job.yaml").write_text(
        "env: {params: {eval_size: 16}}\n"
        "warmup: {enabled: false}\n"
        "rollout: {prompts_per_step: 4, group_size: 2}\n"
        "schedule: {steps: 1, eval_every: 1, checkpoint_every: 1}\n"
    )
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "FLOWRL_HOME": str(tmp_path / "home"),
        "PREFECT_API_URL": PREFECT_API_URL.value(),  # the session's API: no cold start
        "FLOWRL_POOL_GPUS": "0",
        "PYTHONPATH": "",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    flowrl = str(wheel_venv / "bin" / "flowrl")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [flowrl, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )

    where = run("--version")
    assert where.returncode == 0 and where.stdout.startswith("flowrl "), where.stderr
    up = run("infra", "up")
    assert up.returncode == 0, up.stderr[-3000:]
    for deployment in ("rl-train", "rl-train-lora", "sft-train", "retrain", "gpu-probe"):
        assert deployment in up.stdout, up.stdout
    done = run("train", "job.yaml", "--set", "name=user-job")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "models:/user-job/1" in done.stdout
    # The README's example on a pool with no GPUs: refused at submission, naming both numbers.
    refused = run("jobs", "submit", "rl-train", "arithmetic", "--set", "resources.gpus=1")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "resources.gpus=1 but the pool has 0 GPU" in refused.stderr
    shipped = run("train", "arithmetic", "--set", "schedule.steps=0")  # found by name
    assert "config file not found" not in shipped.stderr
    assert "schedule.steps" in shipped.stderr  # ... and validated: steps must be >= 1
    assert shipped.returncode == 2


HEAVY = ("ray", "torch", "transformers", "pyarrow", "prefect", "mlflow")


@pytest.mark.parametrize(
    "argv",
    [None, ["config", "arithmetic"], ["--help"], ["jobs", "--help"], ["config", "--help"]],
    ids=["schemas", "config", "help", "jobs-help", "config-help"],
)
def test_reading_configs_and_the_cli_import_no_engine(argv: list[str] | None):
    """The job schemas import neither Ray, torch, transformers, pyarrow, Prefect nor MLflow, and
    neither does ``flowrl config`` or ``flowrl --help``: they start nothing (``flowrl config``
    took 1.6 s when the schemas pulled in Ray and transformers; ~0.4 s without)."""
    if argv is None:
        run = "import flowrl.tasks.schemas"
    else:
        run = f"from flowrl.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    code = f"import sys\n{run}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_one_place_decides_placement():
    """Only ``backends.policy.placement.place`` builds a ``Placement``: a job's config, the
    Tinker API's flags and ``actors.start_policy`` ask it (docs/architecture.md)."""
    kinds = {"OwnWorkers", "SharedTenant", "InProcess", "VLLMEngines"}
    builders = set()
    for paths in _modules().values():
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    if name in kinds:
                        builders.add(str(path.relative_to(REPO)))
    assert builders == {"backends/policy/placement.py"}, sorted(builders)


MAX_CLASS_LINES = 300
MAX_MODULE_LINES = 600


def test_no_class_over_300_lines_and_no_module_over_600():
    """The library's shape (tests, benchmarks and docs scripts aside): a class that outgrows
    300 lines is split by the state it owns, a module past 600 by what its parts are."""
    big = []
    for paths in _modules().values():
        for path in paths:
            text = path.read_text()
            if text.count("\n") > MAX_MODULE_LINES:
                big.append(f"{path.relative_to(REPO)}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_CLASS_LINES:
                        big.append(f"{path.relative_to(REPO)}:{node.name}: {lines} lines")
    assert not big, big
