"""A user's own environment, outside flowrl's source: named as ``module:Class`` or installed as a
package with a ``flowrl.environments`` entry point, trained with no edit of flowrl.

The environment is the README's worked example (``examples/recall/recall_env.py``), copied out
of the repository: a two-turn game written against the documented contract only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from services import ray_head, run_on_cluster, start_env_service

from flowrl.cli import main
from flowrl.environments.plugin import TRAIN_SEED_SPACING, PluginTask, play
from flowrl.environments.registry import load, make_task
from flowrl.tasks.episodes import episode_succeeded

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "recall"
ENV_SOURCE = (EXAMPLE / "recall_env.py").read_text()


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder outside the repo holding the user's module, on this process's path."""
    folder = tmp_path_factory.mktemp("user-envs")
    (folder / "my_recall.py").write_text(ENV_SOURCE)
    bad = """
        from my_recall import Recall

        class NoStep:
            def reset(self, **row): return "hi"
            def get_system_prompt(self): return ""
            def get_initial_user_message(self): return "hi"

        class ResetRaises(Recall):
            def reset(self, seed, **_):
                raise KeyError("the row has no 'board'")

        class CtorRaises(Recall):
            def __init__(self, **kw):
                raise RuntimeError("licence server unreachable")

        NOT_A_CLASS = 42

        class PlainAnswers(Recall):
            def step(self, action):  # any object with the four fields, not flowrl's StepResult
                import types
                step = super().step(action)
                return types.SimpleNamespace(**vars(step))
    """
    (folder / "my_bad_envs.py").write_text(textwrap.dedent(bad))
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def installed_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same environment as a real package (``pip install --target``) declaring the entry
    point ``recall-game`` in the group ``flowrl.environments``; returns its site folder."""
    src = tmp_path_factory.mktemp("recall-pkg")
    (src / "recall_game").mkdir()
    (src / "recall_game" / "__init__.py").write_text(ENV_SOURCE)
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "recall-game"
            version = "0.1"

            [project.entry-points."flowrl.environments"]
            recall-game = "recall_game:Recall"

            [tool.setuptools]
            packages = ["recall_game"]
            """
        )
    )
    site = tmp_path_factory.mktemp("recall-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--target", str(site), str(src)],
        check=True,
    )
    return site


def _with_path(env: dict[str, str], *folders: Path) -> dict[str, str]:
    paths = [str(f) for f in folders] + [p for p in [env.get("PYTHONPATH")] if p]
    return env | {"PYTHONPATH": os.pathsep.join(paths)}


# --- loading and the contract ---------------------------------------------------------------


def test_a_class_in_a_user_folder_loads_by_module_and_class_name(user_folder):
    loaded = load("my_recall:Recall")
    assert loaded.is_task_config is False and loaded.target.__name__ == "Recall"
    task = make_task("my_recall:Recall", {"low": 10, "high": 20}, eval_size=50, seed=3)
    assert isinstance(task, PluginTask)
    env = task.make_env()
    assert env.reset(seed=1).startswith("Remember ")


def test_generated_rows_are_seeds_and_held_out_seeds_never_reach_training(user_folder):
    task = make_task("my_recall:Recall", {}, eval_size=100, seed=0)
    assert task.eval_set() == [{"seed": m} for m in range(100)]
    source = task.train_source()
    first = source.next_batch(3)
    assert first == [{"seed": TRAIN_SEED_SPACING + i} for i in range(3)]
    state = source.state()
    again = task.train_source()
    again.load_state(state)  # the cursor a checkpoint stores resumes the stream exactly
    assert again.next_batch(2) == source.next_batch(2)
    other = make_task("my_recall:Recall", {}, eval_size=100, seed=1).train_source()
    assert other.next_batch(1) != first[:1]  # the job seed moves the training stream


def test_rows_from_files_go_to_reset_and_reshuffle_each_epoch(user_folder, tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"seed": s, "tag": "t"}) + "\n" for s in range(5)))
    held.write_text(json.dumps({"seed": 99}) + "\n")

    from flowrl.tasks.schemas import EnvDataSection

    data = EnvDataSection(train=str(train), eval=str(held))
    task = make_task("my_recall:Recall", {}, data=data, seed=0)
    assert task.eval_set() == [{"seed": 99}]
    rows = task.train_source().next_batch(10)
    epoch_1, epoch_2 = [r["seed"] for r in rows[:5]], [r["seed"] for r in rows[5:]]
    assert sorted(epoch_1) == sorted(epoch_2) == list(range(5)) and epoch_1 != epoch_2
    env = task.make_env()
    assert env.reset(**rows[0]).startswith("Remember")  # extra fields ("tag") reach reset too


def test_demonstrations_are_played_through_the_environment(user_folder):
    task = make_task("my_recall:Recall", {})
    conversation = task.sft_example({"seed": 7})
    env = task.make_env()
    number = env.demonstration(seed=7)[1]
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant"]
    assert conversation[3]["content"] == "Number?"  # the environment's own observation
    assert conversation[-1]["content"] == number
    assert play(task.make_env(), {"seed": 7}, ["no", "0"])[2:4] == [
        {"role": "assistant", "content": "no"},
        {"role": "user", "content": "Number?"},
    ]


def test_the_first_user_message_is_resets_text_else_get_initial_user_message():
    from flowrl.environments.plugin import first_user_message

    class Env:
        def get_initial_user_message(self) -> str:
            return "from the method"

    assert first_user_message(Env(), "from reset") == "from reset"
    assert first_user_message(Env(), None) == "from the method"
    assert first_user_message(Env(), "") == "from the method"


@pytest.mark.parametrize(
    ("rule", "reward", "info", "expected"),
    [
        ("auto", 0.0, {"correct": True}, True),
        ("auto", 0.5, {}, True),
        ("auto", 0.5, {"correct": False}, False),
        ("info.won", 0.0, {"won": 1}, True),
        ("info.won", 1.0, {}, False),
        ("reward>=0.5", 0.5, {}, True),
        ("reward>0.5", 0.5, {}, False),
        ("reward >= -1", -1.0, {}, True),
    ],
)
def test_the_success_rule_decides_accuracy(rule, reward, info, expected):
    assert episode_succeeded(rule, reward, info) is expected


# --- bad plug-ins: exit 2, the cause named, nothing created ---------------------------------


@pytest.mark.parametrize(
    ("name", "params", "cause"),
    [
        ("no_such_module:Env", {}, "cannot import module 'no_such_module'"),
        ("my_recall:Missing", {}, "has no attribute 'Missing'"),
        ("my_bad_envs:NOT_A_CLASS", {}, "int object is not a class or factory"),
        ("my_bad_envs:NoStep", {}, "lacks method(s) step"),
        ("my_recall:Recall", {"colour": "red"}, "unexpected keyword argument 'colour'"),
        ("my_bad_envs:ResetRaises", {}, "reset(**row) raised KeyError"),
        ("my_bad_envs:CtorRaises", {}, "raised RuntimeError: licence server unreachable"),
        ("recall", {}, "unknown environment 'recall'"),
    ],
)
def test_a_bad_plugin_exits_2_naming_the_cause_before_anything_starts(
    user_folder, tmp_path, monkeypatch, capsys, name, params, cause
):
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "home"))
    overrides = [f"env.name={name}"] + [f"env.params.{k}={v}" for k, v in params.items()]
    args = [a for o in overrides for a in ("--set", o)]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert cause in err, err
    assert not (tmp_path / "home").exists()  # no MLflow store, no storage, no run


# --- training: flowrl train, local / ray / http, both ways of naming -------------------------


def test_the_service_serves_a_user_class_only_when_started_with_it(user_folder):
    import httpx

    env = _with_path(dict(os.environ), user_folder)
    serves = ("my_recall:Recall", "my_bad_envs:PlainAnswers", "tool_math")
    url, proc = start_env_service(*serves, env=env)
    try:
        body = {"job": "j", "episode_id": "e", "row": {"seed": 5}}
        ok = httpx.post(f"{url}/reset", json=body | {"env": {"name": "my_recall:Recall"}})
        assert ok.status_code == 200 and ok.json()["observation"].startswith("Remember")
        plain = {"job": "j", "episode_id": "p", "env": {"name": "my_bad_envs:PlainAnswers"}}
        assert httpx.post(f"{url}/reset", json=plain | {"row": {"seed": 5}}).status_code == 200
        step = httpx.post(f"{url}/step", json={"job": "j", "episode_id": "p", "action": "ok"})
        assert step.status_code == 200 and step.json()["observation"] == "Number?", step.text
        refused = httpx.post(f"{url}/reset", json=body | {"env": {"name": "my_bad_envs:NoStep"}})
        assert refused.status_code == 403 and "not served" in refused.text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    failed = subprocess.run(  # a name that does not load stops the service at start
        [
            sys.executable,
            "-m",
            "flowrl",
            "serve",
            "environments",
            "--env",
            "nope:Env",
            "--insecure-loopback",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode != 0 and "cannot import module 'nope'" in failed.stderr


ACTORS_LEFT = """
import sys, ray
ray.init(address=sys.argv[1], namespace="flowrl", log_to_driver=False)
named = ray.util.list_named_actors(all_namespaces=True)
print("ACTORS " + ",".join(a["name"] for a in named if "-envs-" in a["name"]))
"""


def test_a_user_environment_trains_in_every_mode_both_ways_of_naming_it(
    user_folder, installed_package, tmp_path, prefect_api
):
    """Six short jobs, each ``flowrl train`` with a different (name, mode), on a Ray cluster
    (a head on loopback whose workers have the user's module on their path, as an image
    would) and the environment service started with both names. Each job registers a version;
    the http jobs' episodes were played by the service; the ray-mode jobs' environment actors
    are gone from the cluster once they end."""
    from prefect.settings import PREFECT_API_URL

    env = _with_path(dict(os.environ), user_folder, installed_package)
    env["FLOWRL_HOME"] = str(tmp_path / "home")
    env.pop("MLFLOW_TRACKING_URI", None)
    flowrl = str(Path(sys.executable).with_name("flowrl"))
    url, proc = start_env_service("my_recall:Recall", "recall-game", env=env)
    try:
        with ray_head(env) as address:
            env |= {
                "FLOWRL_RAY_ADDRESS": address,
                "RAY_AUTH_MODE": "token",
                "PREFECT_API_URL": PREFECT_API_URL.value(),  # the session's API: no cold start
            }
            registered = {}
            for name in ("my_recall:Recall", "recall-game"):
                for mode in ("local", "ray", "http"):
                    job = f"plug-{len(registered)}"
                    overrides = [
                        f"name={job}",
                        f"env.name={name}",
                        f"env.mode={mode}",
                        "schedule.steps=2",
                        "schedule.eval_every=2",
                        "warmup.enabled=false",  # warm-up from demonstrations: the README test
                        "rollout.prompts_per_step=4",
                        "env.eval_size=4",
                    ] + ([f"env.service_url={url}"] if mode == "http" else [])
                    done = subprocess.run(
                        [flowrl, "train", str(EXAMPLE / "recall.yaml")]
                        + [a for o in overrides for a in ("--set", o)],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=600,
                    )
                    assert done.returncode == 0, (name, mode, done.stderr[-3000:])
                    registered[f"{name}/{mode}"] = f"models:/{job}/1" in done.stdout
            left = run_on_cluster(ACTORS_LEFT, address, env)
        import httpx

        steps = httpx.get(f"{url}/stats").json()["steps"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert all(registered.values()) and len(registered) == 6, registered
    assert steps > 0  # the http jobs' episodes were played by the service
    assert left.returncode == 0, left.stderr[-2000:]
    actors = next(x for x in left.stdout.splitlines() if x.startswith("ACTORS "))
    assert actors == "ACTORS ", actors  # the ray-mode jobs stopped their environment actors


def test_the_readme_example_trains_with_the_readme_command_and_reward_rises(tmp_path, prefect_api):
    """``PYTHONPATH=examples/recall flowrl train examples/recall/recall.yaml`` (shortened), by
    a user whose Prefect API is the session's (the README game's test runs its command on the
    embedded ephemeral API): warm-up from Recall.demonstration(), then RL; mean reward of the
    last steps beats the first steps'."""
    from prefect.settings import PREFECT_API_URL

    env = _with_path(dict(os.environ), EXAMPLE)
    env["FLOWRL_HOME"] = str(tmp_path / "home")
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()  # no cold start of a Prefect API
    flowrl = Path(sys.executable).with_name("flowrl")
    done = subprocess.run(
        [str(flowrl), "train", str(EXAMPLE / "recall.yaml"), "--set", "schedule.steps=30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = next(x for x in done.stdout.splitlines() if x.startswith("MLflow run")).split()[-1]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    history = client.get_metric_history(run_id, "reward/mean")
    rewards = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(rewards) == 30
    assert client.get_metric_history(run_id, "env/acknowledged")  # an info field, no code
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    print(f"reward/mean first 8 steps {first:.3f}, last 8 {last:.3f}")
    assert last > first + 0.04, (first, last, rewards)


def test_a_class_without_demonstrations_skips_warmup_saying_why(user_folder):
    """Warm-up needs demonstrations (the class's or ``warmup.data``); without them it is skipped
    and says so, and the registered model's input example still comes from the environment."""
    from flowrl.tasks.model import _example_messages, warmup
    from flowrl.tasks.schemas import load_job

    (user_folder / "my_plain.py").write_text(
        "from my_recall import Recall\n\nclass Plain(Recall):\n    demonstration = None\n"
    )
    config = load_job(None, ["env.name=my_plain:Plain"])
    result = warmup.fn(config, None, "file:///base")
    assert result.model_uri == "file:///base" and result.steps == 0
    assert "no demonstration() method and warmup.data is unset" in result.skipped
    example = _example_messages(config)
    assert [m["role"] for m in example] == ["system", "user"]
    assert example[1]["content"].startswith("Remember ")
