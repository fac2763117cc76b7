"""A bad job config fails at once, naming the field, and starts nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.infra.configfile import ConfigError, parse_overrides
from flowrl.infra.settings import Settings
from flowrl.tasks.schemas import RLJobConfig, load_job

REPO = Path(__file__).resolve().parents[1]


def test_shipped_configs_validate():
    from flowrl.tasks.schemas import SelfPlayJobConfig

    for path in sorted((REPO / "configs").glob("*.yaml")):
        kind = SelfPlayJobConfig if "selfplay" in path.name else RLJobConfig
        assert isinstance(load_job(path, kind=kind), kind), path


def test_the_old_schema_module_still_imports_and_warns(monkeypatch):
    """``flowrl.tasks.jobs`` (the schemas' old home) gives users' imports the very same
    classes, with a DeprecationWarning naming the new module."""
    import importlib

    from flowrl.tasks import schemas

    monkeypatch.delitem(sys.modules, "flowrl.tasks.jobs", raising=False)
    with pytest.warns(DeprecationWarning, match=r"flowrl\.tasks\.schemas"):
        old = importlib.import_module("flowrl.tasks.jobs")
    assert old.RLJobConfig is schemas.RLJobConfig and old.load_job is schemas.load_job
    assert old.__all__ and all(getattr(old, n) is getattr(schemas, n) for n in old.__all__)
    cfg = old.load_job(None, ["seed=3"])
    assert isinstance(cfg, schemas.RLJobConfig) and cfg.seed == 3


def test_overrides_are_typed_and_nested():
    cfg = load_job(None, ["schedule.steps=7", "model.lora.enabled=true", "seed=3"])
    assert cfg.schedule.steps == 7 and cfg.model.lora.enabled is True and cfg.seed == 3
    rollout = load_job(None, ["rollout.unfinished_turn_reward=-0.5"]).rollout
    for limits in (rollout.limits(), rollout.limits(greedy=True)):  # training and evaluation
        assert limits.unfinished_turn_reward == -0.5
    assert parse_overrides(["env.params.operators=['+', '-']"]) == {
        "env": {"params": {"operators": ["+", "-"]}}
    }


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["schedule.stepz=3"], "schedule.stepz"),  # unknown key
        (["schedule.steps=many"], "schedule.steps"),  # wrong type
        (["rollout.group_size=0"], "rollout.group_size"),  # out of range
        (["algorithm.loss=nonsense"], "algorithm.loss"),  # unknown registry name
        (["env.name=chess"], "env"),  # unknown environment
        (["env.params.max_operand=-5"], "max_operand"),  # bad environment parameter
        (["name=Has Spaces"], "name"),
        (["warmup.target_accuracy=1.5"], "warmup.target_accuracy"),
        (["rollout.unfinished_turn_reward=0.5"], "rollout.unfinished_turn_reward"),  # a bonus
        (["rollout.unfinished_turn_reward=-inf"], "rollout.unfinished_turn_reward"),
        (["algorithm.max_grad_norm=inf"], "algorithm.max_grad_norm"),  # no float is inf or nan
        (["algorithm.clip_eps_high=nan"], "algorithm.clip_eps_high"),
        (["algorithm.tis_cap=1"], "algorithm.tis_cap"),  # a cap of 1 or less weights nothing up
        (["algorithm.tis_cap=0.5"], "algorithm.tis_cap"),
        (["algorithm.is_correction=vtrace"], "algorithm.is_correction"),
        (["algorithm.mis_band=[1.0,2.0]"], "algorithm.mis_band"),
        (["algorithm.is_cap=1"], "algorithm.is_cap"),
        (["algorithm.tis_cap=2", "algorithm.is_correction=mis"], "algorithm"),
        (["schedule.max_staleness=9"], "schedule.max_staleness"),
        (["schedule.max_staleness=2", "schedule.off_policy_steps=1"], "schedule"),
        (["env.name=gomoku", "env.params.win_reward=inf"], "env.params.win_reward"),
        (["env.name=tool_math", "env.params.format_reward=nan"], "env.params.format_reward"),
    ],
)
def test_bad_values_name_the_field(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_job(None, overrides)
    assert named in str(err.value)


def test_tis_cap_is_off_by_default_reaches_the_loss_config_and_must_exceed_one():
    assert load_job(None).algorithm.loss_config()["is_correction"] is None
    tis = {"name": "tis", "cap": 2.0}
    assert load_job(None, ["algorithm.tis_cap=2"]).algorithm.loss_config()["is_correction"] == tis
    mis = ["algorithm.is_correction=mis", "algorithm.mis_band=[0.8,1.25]"]
    assert load_job(None, mis).algorithm.loss_config()["is_correction"] == {
        "name": "mis",
        "cap": 2.0,
        "band": [0.8, 1.25],
    }
    with pytest.raises(ConfigError, match=r"algorithm\.tis_cap.*greater than 1"):
        load_job(None, ["algorithm.tis_cap=1.0"])


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="not found"):
        load_job("/nonexistent/job.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_job(None, ["schedule.steps"])


def test_cli_rejects_bad_config_before_starting_anything(tmp_path):
    """Exit code 2, the field named on stderr, and no job state written anywhere."""
    env = {"FLOWRL_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl", "train", "--set", "rollout.temperature=-1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "rollout.temperature" in proc.stderr
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("{tmp}/nowhere", "no such folder"),
        ("{tmp}/empty", "no config.json"),
        ("models:/never-registered/3", "never-registered"),
    ],
)
def test_cli_checks_model_source_before_starting_anything(tmp_path, source, says):
    """A model.source that cannot be a model: exit 2 within seconds, one line naming it (no
    traceback), and no job state written anywhere."""
    (tmp_path / "empty").mkdir()
    source = source.format(tmp=tmp_path)
    env = {"FLOWRL_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl", "train", "--set", f"model.source={source}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"model.source {source!r}" in proc.stderr and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "home" / "storage").exists()


def test_shipped_configs_load_by_name():
    """``flowrl train arithmetic`` reads the config shipped with flowrl; an unknown name lists
    the shipped ones."""
    from flowrl.infra.configfile import ConfigError, shipped_configs
    from flowrl.tasks.schemas import load_job

    assert {"arithmetic", "arithmetic-lora", "gomoku-selfplay"} <= set(shipped_configs())
    assert load_job("arithmetic") == load_job(REPO / "configs" / "arithmetic.yaml")
    assert load_job("arithmetic-lora.yaml").model.lora.enabled
    with pytest.raises(ConfigError, match="arithmetic-lora"):
        load_job("no-such-config")
    with pytest.raises(ConfigError, match="not found"):
        load_job("somewhere/arithmetic")  # a path is a path, never a name


def test_settings_default_to_embedded_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path))
    for var in ("FLOWRL_STORAGE_URL", "FLOWRL_MLFLOW_TRACKING_URI", "FLOWRL_RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    s = Settings()
    assert s.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert s.storage_root == str(tmp_path / "storage")
    assert s.ray_address is None and s.prefect_api_url is None
    monkeypatch.setenv("FLOWRL_STORAGE_URL", "s3://bucket/prefix")
    assert Settings().storage_root == "s3://bucket/prefix"


def _dotted_fields(model, prefix=""):
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _dotted_fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_readme_documents_every_config_field():
    from flowrl.environments.registry import installed_names, load

    guide = (REPO / "docs" / "configuration.md").read_text()
    missing = [f for f in _dotted_fields(RLJobConfig) if f"`{f}`" not in guide]
    for name in installed_names():
        missing += [f for f in load(name).target.model_fields if f"`{f}`" not in guide]
    assert not missing, f"docs/configuration.md lacks config fields: {missing}"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"name: [open\nseed: 1\n", "job.yaml: line 2"),  # a YAML syntax error, with its line
        (b"name: a\nseed: !!python/object/apply:os.system ['true']\n", "job.yaml: line 2"),
        (b"name: a\nseed: 1\nseed: 2\n", "line 3, column 1: duplicate key 'seed'"),
        (b"name: a\nenv:\n  name: tool_math\n  name: gomoku\n", "duplicate key 'name'"),
        (b"name: caf\xe9\n", "job.yaml: line 1: not UTF-8"),
        (b"env:\n  name: tool_math\n  params: {bogus: 1}\n", "env.params.bogus"),
        (b"rollout: {group_size: 1000000000}\n", "rollout.group_size"),
        (b"rollout: {prompts_per_step: 1000000000}\n", "rollout.prompts_per_step"),
        (b"seed: 1.0e+30\n", "seed"),
        (b"rollout: {max_context_tokens: 100000}\n", "rollout.max_context_tokens=100000 exceeds"),
        (b"env: {mode: http, service_url: 'file:///etc/passwd'}\n", "env.service_url"),
        (b"env: {mode: http, service_url: 'http://al:s3cret@127.0.0.1:1'}\n", "env.service_url"),
        (
            b"model: {source: 'https://user:s3cret@example.org/m'}\n",
            "model.source: Value error, a URL holds credentials",
        ),
    ],
)
def test_every_config_edge_exits_2_naming_the_field_or_line(
    tmp_path, monkeypatch, capsys, text, says
):
    from flowrl.cli import main

    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "home"))
    path = tmp_path / "job.yaml"
    path.write_bytes(text)
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "s3cret" not in err, err


def test_retrain_refuses_a_negative_min_improvement():
    from flowrl.infra.configfile import load_config
    from flowrl.tasks.schemas import RetrainConfig

    with pytest.raises(ConfigError, match="min_improvement"):
        load_config(None, ["min_improvement=-1e9"], RetrainConfig)


def test_sampler_auto_is_the_default_and_its_rules_give_their_reason(model_dir, tmp_path):
    """``resources.sampler_backend`` defaults to auto, which a job decides when it starts
    (``pick_sampler``): vLLM for a model of at least the settings' size on GPU workers (CPU
    workers with ``FLOWRL_VLLM_AUTO_ON_CPU``) where vLLM's venv is and the job can run it;
    else HF, each time saying why. The size is read from the
    safetensors headers alone (the tiny model: 0.34M numbers); a file that is not
    safetensors gives no size, and HF."""
    from flowrl.backends.models.model_folder import weight_count
    from flowrl.backends.policy.resources import pick_sampler

    assert RLJobConfig().resources.sampler_backend == "auto"
    assert Settings().vllm_auto_min_parameters == 1_000_000
    assert Settings().vllm_auto_on_cpu is False
    count = weight_count(model_dir)
    assert count is not None and 330_000 < count < 350_000, count
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    assert weight_count(str(bad)) is None and weight_count(str(tmp_path)) is None
    job = dict(vision=False, colocate=None, placement="own", vllm_python="/v/bin/python", gpus=True)
    big = dict(parameters=3_200_000, min_parameters=1_000_000)
    cases = [
        ({**job, **big, "vllm_present": True}, "vllm", "3.20M parameters, at least"),
        ({**job, **big, "vllm_present": False}, "hf", "no vLLM venv at /v/bin/python"),
        (
            {**job, "parameters": count, "min_parameters": 10**6, "vllm_present": True},
            "hf",
            "0.34M parameters, below",
        ),
        ({**job, **big, "vllm_present": True, "vision": True}, "hf", "takes no images"),
        ({**job, **big, "vllm_present": True, "colocate": True}, "hf", "colocate"),
        ({**job, **big, "vllm_present": True, "placement": "shared"}, "hf", "shared worker"),
        ({**job, **big, "vllm_present": True, "gpus": False}, "hf", "CPU workers"),
        ({**job, **big, "vllm_present": True, "gpus": False, "on_cpu": True}, "vllm", "at least"),
        (
            {**job, "parameters": None, "min_parameters": 0, "vllm_present": True},
            "hf",
            "size is unknown",
        ),
    ]
    for kwargs, backend, why in cases:
        choice = pick_sampler(**kwargs)
        assert (choice.backend, why in choice.why) == (backend, True), (kwargs, choice)
    shared = {"placement": "shared", "sampler_backend": "vllm"}
    with pytest.raises(ValueError, match="sampler_backend hf or auto"):
        RLJobConfig.model_validate({"model": {"lora": {"enabled": True}}, "resources": shared})


def test_threads_auto_gives_a_policy_the_cores_it_would_leave_idle(monkeypatch):
    """``resources.torch_threads`` defaults to auto: on a CPU machine a job's workers get the
    cores (``FLOWRL_CPU_THREADS``) that one thread each would leave idle. Workers that take
    turns get them all; a trainer that trains while its samplers sample ahead keeps them all,
    the samplers half; GPU workers and a shared worker's tenants keep one. Numbers that the
    config sets win, and each decision says why."""
    assert RLJobConfig().resources.torch_threads == "auto"
    monkeypatch.setenv("FLOWRL_CPU_THREADS", "4")

    def build(*overrides: str):
        return load_job(None, list(overrides)).placement_for().build

    cases = [
        ((), (4, 4), "one actor samples and trains in turn on 4 cores"),
        (("resources.colocate=false",), (4, 4), "take turns on 4 cores"),
        (("resources.colocate=false", "resources.samplers=2"), (2, 4), "take turns"),
        (("schedule.off_policy_steps=1",), (2, 4), "sample ahead, on 4 cores"),
        (("schedule.max_staleness=2", "resources.samplers=2"), (1, 4), "sample ahead"),
        (("resources.gpus=1",), (1, 1), "GPU workers"),
        (("resources.torch_threads=3",), (3, 3), ""),
        (("resources.trainer_threads=2",), (4, 2), "in turn"),
    ]
    for overrides, (sampler, trainer), why in cases:
        b = build(*overrides)
        assert (b.torch_threads, b.trainer_threads or b.torch_threads) == (sampler, trainer), (
            overrides,
            b,
        )
        assert why in b.threads_why and (why != "") == bool(b.threads_why), (overrides, b)
    monkeypatch.delenv("FLOWRL_CPU_THREADS")
    import os

    assert build().torch_threads == len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match="torch_threads"):
        load_job(None, ["resources.torch_threads=0"])
    with pytest.raises(ConfigError, match="torch_threads"):
        load_job(None, ["resources.torch_threads=many"])
