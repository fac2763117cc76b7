"""The ``evaluate`` job: models side by side (greedy accuracy, pass@k, avg@k) on the real
Prefect API, Ray and MLflow; the unbiased pass@k estimator against hand computations."""

from __future__ import annotations

import itertools
import math

import pytest

from flowrl.infra.configfile import ConfigError
from flowrl.tasks.evaluate import pass_at_k
from flowrl.tasks.schemas import EvalJobConfig, load_job


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # one right of four: a single draw hits it 1 time in 4
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (4, 1, 4, 1.0),
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 1, 0.3),
    ],
)
def test_pass_at_k_by_hand(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample() -> None:
    """By enumeration: of all C(n, k) ways to draw k of the n samples, the share that holds at
    least one correct one."""
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                draws = list(itertools.combinations(samples, k))
                share = sum(any(d) for d in draws) / len(draws)
                assert math.isclose(pass_at_k(n, c, k), share), (n, c, k)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="k=8 needs 1 <= k <= samples=4"):
        EvalJobConfig(k=[1, 8])
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ConfigError, match="arithmetik"):
        load_job(None, ["envs=[{name: arithmetik}]"], EvalJobConfig)


def test_a_model_that_does_not_resolve_exits_2_before_anything_runs(tmp_path, capsys):
    from flowrl.cli import main

    missing = tmp_path / "no-such-model"
    assert main(["eval", "--set", f"models=[{missing}]"]) == 2
    err = capsys.readouterr().err
    assert "does not resolve" in err and str(missing) in err


@pytest.fixture(scope="module")
def registered(prefect_api, flowrl_home):
    """A version registered by a short rl-train job (its final held-out accuracy known)."""
    from flowrl.flows.rl import rl_train

    config = load_job(
        None,
        [
            "name=eval-source",
            "env.params.eval_size=16",
            "rollout.prompts_per_step=8",
            "schedule.steps=2",
            "schedule.eval_every=2",
            "schedule.checkpoint_every=2",
        ],
    )
    return rl_train(config)


def test_evaluate_compares_models_side_by_side(registered, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flowrl.flows.evaluate import evaluate
    from flowrl.infra import tracking
    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage

    base = tracking.client().get_model_version("eval-source", "1").tags["flowrl.base_model"]
    config = load_job(
        None,
        [
            "name=eval-two",
            f"models=[{registered.model_uri}, {base}]",
            "envs=[{name: arithmetic, params: {eval_size: 16}}]",
            "samples=4",
            "k=[1, 4]",
        ],
        EvalJobConfig,
    )
    result = evaluate(config)
    assert result.models == ["models:/eval-source/1", base]
    trained, start = result.scores[0][0], result.scores[1][0]
    # Greedy accuracy is training's own held-out evaluation: the same number the job reported.
    assert trained.greedy_accuracy == pytest.approx(registered.accuracy_end)
    for score in (trained, start):
        assert score.prompts == 16 and score.samples == 4 and score.failed == 0
        assert 0 <= score.pass_at[1] <= score.pass_at[4] <= 1
        assert score.avg_at == pytest.approx(score.pass_at[1])  # unbiased pass@1 = avg@n
    print(f"\ntrained {trained}\nbase {start}")

    # result.json, the models' MLflow runs, the version's tags, the Prefect table.
    stored = Storage(get_settings().storage_root).read_json("jobs/eval-two/result.json")
    assert stored["models"] == result.models and len(stored["scores"]) == 2
    c = tracking.client()
    version = c.get_model_version("eval-source", "1")
    assert version.tags["flowrl.eval.run_id"] == result.model_runs[0]
    assert float(version.tags["flowrl.eval.arithmetic.pass_at_4"]) == pytest.approx(
        trained.pass_at[4], abs=1e-4
    )
    run = c.get_run(result.model_runs[1])
    assert run.data.tags["flowrl.eval.model"] == base
    assert run.data.metrics["arithmetic/greedy_accuracy"] == pytest.approx(start.greedy_accuracy)
    with get_client(sync_client=True) as client:
        (table,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["eval-two-models"]))
        )
    import json

    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    metrics = {row["metric"]: row for row in rows}
    assert set(metrics) >= {"greedy_accuracy", "pass@1", "pass@4", "avg@4", "failed"}
    assert metrics["pass@4"][base] == pytest.approx(start.pass_at[4], abs=1e-4)
