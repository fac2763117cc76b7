"""reasoning-gym's datasets as environments by name (``env.name: reasoning_gym:<dataset>``),
with the real library (the ``envs`` extra, part of ``dev``)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import reasoning_gym  # noqa: F401 - the real library (the envs extra): never skipped
from pydantic import ValidationError

from flowrl.environments import reasoning_gym as rg_env
from flowrl.environments.registry import EnvironmentLoadError, env_builder, load, make_task
from flowrl.tasks.schemas import load_job

# One arithmetic, one algorithmic, one logic dataset: small configs keep them quick.
DATASETS = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "word_sorting": {"min_words": 3, "max_words": 4},
    "syllogism": {},
}
WRONG = "<answer>certainly not this</answer>"


def _task(name: str, **params):
    return make_task(f"reasoning_gym:{name}", {**DATASETS.get(name, {}), **params})


def _score(task, row: dict, reply: str):
    env = task.make_env()
    assert env.reset(**row) == row["question"]
    assert env.get_initial_user_message() == row["question"]
    return env.step(reply)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_datasets_load_by_name_as_task_configs(name):
    loaded = load(f"reasoning_gym:{name}")
    assert loaded.is_task_config and not loaded.is_game
    assert loaded.target.dataset_name == name
    task = _task(name, eval_size=5)
    assert task.model_extra == DATASETS[name]  # the dataset's config, apart from flowrl's
    rows = task.eval_set()
    assert len(rows) == 5 and all(r["dataset"] == name for r in rows)


def test_every_registry_name_resolves_but_those_whose_scorer_runs_the_answer():
    names = rg_env.dataset_names()
    assert len(names) >= 100 and set(DATASETS) <= set(names)
    assert rg_env.EVALUATING_SCORERS <= set(names)
    for name in names:  # reasoning-gym's own registry, not a list of ours
        if name in rg_env.EVALUATING_SCORERS:
            with pytest.raises(EnvironmentLoadError, match="evaluates the model's answer"):
                load(f"reasoning_gym:{name}")
        else:
            assert load(f"reasoning_gym:{name}").target.dataset_name == name


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_rows_are_deterministic_and_train_and_held_out_are_disjoint(name):
    task = _task(name, eval_size=20, seed=3, chunk_size=16)
    held_out = task.eval_set()
    train = [task.problem(i) for i in range(60)]
    again = _task(name, eval_size=20, seed=3, chunk_size=16)
    assert again.eval_set() == held_out
    assert [again.problem(i) for i in range(60)] == train
    assert task.train_source(7).next_batch(3) == train[7:10]
    held_questions = {r["question"] for r in held_out}
    assert len(held_questions) == 20  # distinct
    assert not held_questions & {r["question"] for r in train}
    assert not {r["seed"] for r in held_out} & {r["seed"] for r in train}  # disjoint seeds
    assert _task(name, eval_size=20, seed=4, chunk_size=16).eval_set() != held_out


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_correct_answer_scores_one_and_wrong_answer_zero_through_step(name):
    task = _task(name, eval_size=8)
    for row in task.eval_set():
        right = _score(task, row, row["answer"])
        assert (right.reward, right.done, right.info["correct"]) == (1.0, True, True)
        tagged = _score(task, row, f"thinking...\n<answer>{row['answer']}</answer>")
        assert tagged.reward == 1.0 and tagged.info["correct"]
        wrong = _score(task, row, WRONG)
        assert (wrong.reward, wrong.info["correct"]) == (0.0, False)


def test_partial_scores_are_rewards_but_not_correct():
    task = _task("basic_arithmetic", eval_size=4)
    row = task.eval_set()[0]
    result = _score(task, row, f"{row['answer']} and more words")  # the scorer's partial credit
    assert 0.0 < result.reward < 1.0 and result.info["correct"] is False


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_demonstrations_are_the_datasets_correct_answers(name):
    task = _task(name, eval_size=4, system_prompt="Answer.")
    assert task.has_demonstrations
    for row in [task.problem(i) for i in range(6)]:
        messages = task.sft_example(row)
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert messages[1]["content"] == row["question"]
        assert _score(task, row, messages[2]["content"]).reward == 1.0


def test_rows_are_references_and_hostile_rows_or_answers_are_refused():
    task = _task("basic_arithmetic", eval_size=4)
    row = task.eval_set()[0]
    env = task.make_env()
    # The question and answer a row carries are not trusted: the entry is rebuilt.
    assert env.reset(**{**row, "question": "2+2=", "answer": "5"}) == row["question"]
    assert env.step(row["answer"]).reward == 1.0
    for bad in ({"dataset": "spiral_matrix"}, {"seed": -1}, {"index": 10**9}, {"index": "0"}):
        with pytest.raises(ValueError, match="row's"):
            env.reset(**{**row, **bad})
    for reply in ("__import__('os').system('true')", "eval('1')", "x" * 5000):
        env.reset(**row)
        result = env.step(reply)
        assert result.reward == 0.0 and "rejected" in result.info


def test_composite_trains_several_datasets_with_weights_as_one_job():
    params = {
        "eval_size": 30,
        "datasets": [
            {"name": "basic_arithmetic", "weight": 3, "config": DATASETS["basic_arithmetic"]},
            {"name": "word_sorting", "weight": 1, "config": DATASETS["word_sorting"]},
        ],
    }
    task = make_task("reasoning_gym:composite", params)
    rows = [task.problem(i) for i in range(200)]
    counts = {n: sum(r["dataset"] == n for r in rows) for n in ("basic_arithmetic", "word_sorting")}
    assert counts["basic_arithmetic"] > 2 * counts["word_sorting"] > 0  # weights 3:1
    held_out = task.eval_set()
    assert {r["dataset"] for r in held_out} == set(counts)
    assert not {r["question"] for r in held_out} & {r["question"] for r in rows}
    for row in held_out[:10] + rows[:10]:  # each row scored by its own dataset's scorer
        assert _score(task, row, task.sft_example(row)[-1]["content"]).reward == 1.0
        assert _score(task, row, WRONG).reward == 0.0
    with pytest.raises(ValidationError, match="basic_arithmetic"):
        make_task("reasoning_gym:composite", {"datasets": [{"name": "basic_arithmetc"}]})
    with pytest.raises(ValidationError, match="duplicate"):
        make_task("reasoning_gym:composite", {"datasets": [{"name": "syllogism"}] * 2})


def test_unknown_dataset_lists_the_nearest_names():
    with pytest.raises(EnvironmentLoadError) as err:
        load("reasoning_gym:basic_arithmetik")
    message = str(err.value)
    assert "unknown reasoning-gym dataset 'basic_arithmetik'" in message
    assert "nearest: basic_arithmetic" in message


def test_a_config_field_the_dataset_rejects_gives_its_own_message():
    with pytest.raises(ValidationError) as err:
        make_task("reasoning_gym:basic_arithmetic", {"min_terms": 5, "max_terms": 2})
    assert "max_terms must be >= min_terms" in str(err.value)  # the dataset's own assertion
    with pytest.raises(ValidationError, match="unexpected keyword argument 'bogus'"):
        make_task("reasoning_gym:basic_arithmetic", {"bogus": 1})
    with pytest.raises(ValidationError, match="set by flowrl"):
        make_task("reasoning_gym:basic_arithmetic", {"size": 10})


def test_job_config_names_a_dataset_and_its_params():
    overrides = ["env.name=reasoning_gym:word_sorting", "env.params={}"]
    assert load_job(None, overrides).env.task().dataset_name == "word_sorting"


def test_tasks_and_env_builders_pickle_by_name():
    task = _task("basic_arithmetic", eval_size=4)
    assert type(task).__qualname__ == "Task_basic_arithmetic"
    again = pickle.loads(pickle.dumps(task))
    assert type(again) is type(task) and again == task
    params = {**DATASETS["basic_arithmetic"], "eval_size": 4}
    build = pickle.loads(pickle.dumps(env_builder("reasoning_gym:basic_arithmetic", params)))
    row = again.eval_set()[0]
    assert build().reset(**row) == row["question"]


def test_flowrl_imports_without_reasoning_gym(monkeypatch):
    code = (
        "import sys; sys.modules['reasoning_gym'] = None\n"  # a failing import
        "import flowrl.environments.registry as r\n"
        "assert r.load('arithmetic').is_task_config\n"
        "try:\n"
        "    r.load('reasoning_gym:basic_arithmetic')\n"
        "except r.EnvironmentLoadError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'flowrl[envs]'" in out.stdout and "reasoning_gym:basic_arithmetic" in (
        out.stdout
    )
    # The same in this process (load's cache cleared: it holds names loaded before).
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    load.cache_clear()
    try:
        for name in ("reasoning_gym:syllogism", "reasoning_gym:composite"):
            with pytest.raises(EnvironmentLoadError, match=r"pip install 'flowrl\[envs\]'"):
                load(name)
    finally:
        load.cache_clear()


def test_answer_extraction_takes_the_last_answer_tag_else_the_whole_reply():
    assert rg_env.extract_answer(" 42 \n") == "42"
    assert rg_env.extract_answer("<answer>1</answer> no, <answer> 2 </answer>") == "2"
    assert rg_env.extract_answer("<answer>unclosed") == "<answer>unclosed"


def test_an_enum_config_field_takes_text_as_yaml_gives_it():
    task = _task("word_sorting", eval_size=4, transformation="uppercase")
    assert all(r["question"] for r in task.eval_set())
    words = task.eval_set()[0]["answer"].split(", ")
    assert all(w == w.upper() for w in words)


def test_a_list_of_enums_takes_text_too_and_a_config_that_fails_on_a_row_fails_early():
    """aiw's ``task_types: list[TaskType]`` from YAML text: the dataset draws the named kinds
    only; a member name it does not know is refused before a job starts (the dataset fails
    only when it draws a row, so the check draws one)."""
    task = _task("aiw", eval_size=6, task_types=["friends"], task_type_weights=[1.0])
    assert all("friend" in r["question"] for r in task.eval_set())
    with pytest.raises(ValidationError, match="rejects its config"):
        _task("aiw", eval_size=6, task_types=["cousins"], task_type_weights=[1.0])
