"""Arithmetic environment and task, the registry, and the data sources."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from flowrl.environments.arithmetic import ArithmeticEnv, ArithmeticTask
from flowrl.environments.data import GeneratedSource, StaticSource, load_rows
from flowrl.environments.registry import load, make_task
from flowrl.environments.types import DataSource, Environment

# --- ArithmeticEnv ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "reward"),
    [("19", 1.0), (" 19\n", 1.0), ("019", 0.0), ("19.", 0.0), ("1 9", 0.0), ("", 0.0)],
)
def test_arithmetic_env_rewards_exact_match_after_stripping(action, reward):
    env = ArithmeticEnv()
    assert env.reset(question="12+7=", answer="19", extra="ignored") == "12+7="
    result = env.step(action)
    assert (result.reward, result.done, result.info) == (reward, True, {"correct": reward == 1.0})


def test_arithmetic_env_is_an_environment_with_a_short_default_prompt():
    env = ArithmeticEnv()
    assert isinstance(env, Environment)
    assert env.get_system_prompt() == ""
    env.reset(question="3-5=", answer="-2")
    assert env.get_initial_user_message() == "3-5="
    assert env.step("-2").reward == 1.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step("-2")  # the episode is over
    assert ArithmeticEnv(system_prompt="calc").get_system_prompt() == "calc"


# --- ArithmeticTask -----------------------------------------------------------------------


def _is_correct(row: dict) -> bool:
    a, op, b = re.fullmatch(r"(\d+)([+*-])(\d+)=", row["question"]).groups()
    value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    return row["answer"] == str(value)


def test_problems_are_correct_deterministic_and_cover_all_operators():
    task = ArithmeticTask(operators=["+", "-", "*"], seed=3)
    rows = [task.problem(i) for i in range(300)]
    assert all(_is_correct(r) for r in rows)
    assert rows == [
        ArithmeticTask(operators=["+", "-", "*"], seed=3).problem(i) for i in range(300)
    ]
    assert {r["question"][-2] for r in rows} <= set("0123456789")
    assert {op for r in rows for op in "+-*" if op in r["question"]} == {"+", "-", "*"}
    assert any(r["answer"].startswith("-") for r in rows)  # negative answers for "-"
    assert rows != [
        ArithmeticTask(operators=["+", "-", "*"], seed=4).problem(i) for i in range(300)
    ]


def test_operands_stay_in_their_ranges():
    task = ArithmeticTask(
        min_operand=10, max_operand=12, min_operand2=3, max_operand2=4, eval_size=2
    )
    pairs = {tuple(map(int, task.problem(i)["question"][:-1].split("+"))) for i in range(200)}
    assert pairs | {tuple(map(int, r["question"][:-1].split("+"))) for r in task.eval_set()} == {
        (a, b) for a in (10, 11, 12) for b in (3, 4)
    }


def test_eval_set_is_fixed_distinct_and_disjoint_from_training():
    task = ArithmeticTask()
    eval_set = task.eval_set()
    assert len(eval_set) == 200
    assert len({r["question"] for r in eval_set}) == 200
    assert eval_set == ArithmeticTask().eval_set()
    assert eval_set != ArithmeticTask(seed=1).eval_set()
    assert task.model_copy(update={"seed": 1}).eval_set() == ArithmeticTask(seed=1).eval_set()
    held_out = {r["question"] for r in eval_set}
    training = {task.problem(i)["question"] for i in range(5000)}
    assert not training & held_out
    assert len(training) > 0.97 * (task.problem_space - 200)  # and reaches nearly all the rest


def test_training_problems_avoid_a_nearly_full_eval_set():
    task = ArithmeticTask(max_operand=3, max_operand2=1, operators=["+", "-"], eval_size=15)
    (only_left,) = {task.problem(i)["question"] for i in range(50)}
    assert only_left not in {r["question"] for r in task.eval_set()}


def test_train_source_resumes_from_its_cursor():
    source = ArithmeticTask().train_source()
    assert isinstance(source, DataSource)
    first = source.next_batch(7)
    assert first == [ArithmeticTask().problem(i) for i in range(7)]
    saved = source.state()
    assert saved == {"index": 7}
    after = source.next_batch(5)
    source.next_batch(3)
    source.load_state(json.loads(json.dumps(saved)))
    assert source.next_batch(5) == after
    assert ArithmeticTask().train_source(start=7).next_batch(5) == after


def test_sft_example_and_make_env_share_the_system_prompt():
    row = {"question": "2+2=", "answer": "4"}
    assert ArithmeticTask().sft_example(row) == [
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    task = ArithmeticTask(system_prompt="calc")
    assert task.sft_example(row)[0] == {"role": "system", "content": "calc"}
    assert task.make_env().get_system_prompt() == "calc"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"min_operand": 5, "max_operand": 4}, "min_operand"),
        ({"min_operand2": 5, "max_operand2": 4}, "min_operand2"),
        ({"min_operand": -1}, "min_operand"),
        ({"max_operand2": -3}, "max_operand2"),
        ({"operators": []}, "operators"),
        ({"operators": ["/"]}, "operators"),
        ({"operators": ["+", "+"]}, "operators"),
        ({"eval_size": 0}, "eval_size"),
        ({"eval_size": 1000}, "eval_size"),  # 100 * 10 problems: none left to train on
        ({"max_operands": 5}, "max_operands"),
    ],
)
def test_bad_task_values_fail_naming_the_field(params, message):
    with pytest.raises(ValidationError, match=message):
        ArithmeticTask(**params)


def test_task_is_frozen_and_every_field_is_described():
    task = ArithmeticTask()
    with pytest.raises(ValidationError):
        task.seed = 1
    assert all(f.description for f in ArithmeticTask.model_fields.values())


# --- registry -----------------------------------------------------------------------------


def test_make_task_by_name():
    assert load("arithmetic").target is ArithmeticTask  # an entry point of flowrl's own package
    assert make_task("arithmetic", {"max_operand": 9, "eval_size": 10}) == ArithmeticTask(
        max_operand=9, eval_size=10
    )
    with pytest.raises(ValueError, match="unknown environment 'chess'.*arithmetic"):
        make_task("chess", {})
    with pytest.raises(ValidationError, match="eval_size"):
        make_task("arithmetic", {"eval_size": 0})


# --- data sources -------------------------------------------------------------------------

ROWS = [{"question": f"{i}+0=", "answer": str(i)} for i in range(20)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_load_rows_reads_jsonl_json_and_parquet(tmp_path):
    assert load_rows(_write_jsonl(tmp_path / "d.jsonl", ROWS)) == ROWS
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    assert load_rows(str(tmp_path / "d.json")) == ROWS
    assert load_rows(_write_parquet(tmp_path / "d.parquet", ROWS)) == ROWS
    assert load_rows(f"file://{tmp_path}/d.parquet") == ROWS


def test_load_rows_reads_any_fsspec_url():
    import fsspec

    with fsspec.open("memory://flowrl-test/rows.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    assert load_rows("memory://flowrl-test/rows.jsonl") == ROWS[:3]


def test_load_rows_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        load_rows(missing)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        StaticSource.from_uri(str(tmp_path / "nope.parquet"), seed=0)
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"rows\.csv.*extension"):
        load_rows(str(tmp_path / "rows.csv"))
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        load_rows(str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no rows"):
        StaticSource.from_uri(str(tmp_path / "empty.jsonl"))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_static_source_reshuffles_each_epoch_and_resumes(tmp_path, fmt):
    write = _write_jsonl if fmt == "jsonl" else _write_parquet
    uri = write(tmp_path / f"rows.{fmt}", ROWS)
    source = StaticSource.from_uri(uri, seed=5)
    assert isinstance(source, DataSource) and len(source) == 20

    epoch0, epoch1 = source.next_batch(20), source.next_batch(20)
    key = lambda rows: [r["question"] for r in rows]  # noqa: E731
    assert sorted(key(epoch0)) == sorted(key(ROWS)) == sorted(key(epoch1))
    assert key(epoch0) != key(ROWS) and key(epoch0) != key(epoch1)
    assert source.state() == {"epoch": 1, "index": 20}
    assert StaticSource.from_uri(uri, seed=5).next_batch(40) == epoch0 + epoch1
    assert StaticSource.from_uri(uri, seed=6).next_batch(20) != epoch0

    # Resume mid-epoch and across an epoch boundary, through a JSON round trip.
    source = StaticSource.from_uri(uri, seed=5)
    source.next_batch(13)
    saved = json.loads(json.dumps(source.state()))
    expected = source.next_batch(30)  # crosses into epoch 2
    source.next_batch(4)
    restored = StaticSource.from_uri(uri, seed=5)
    restored.load_state(saved)
    assert restored.next_batch(30) == expected
    source.load_state(saved)
    assert source.next_batch(30) == expected


def test_static_source_without_shuffle_keeps_file_order_and_validates_state():
    source = StaticSource(ROWS[:3], seed=0, shuffle=False)
    assert source.next_batch(7) == ROWS[:3] + ROWS[:3] + ROWS[:1]
    source.next_batch(1)[0]["question"] = "mutated"  # callers get copies
    assert source.next_batch(3) == ROWS[2:3] + ROWS[:2]
    with pytest.raises(ValueError, match="invalid StaticSource state"):
        source.load_state({"epoch": 0, "index": 4})
    with pytest.raises(ValueError, match="at least one row"):
        StaticSource([], seed=0)


def test_generated_source_cursor_is_the_index():
    source = GeneratedSource(lambda i: {"i": i}, start=2)
    assert source.next_batch(3) == [{"i": 2}, {"i": 3}, {"i": 4}]
    assert source.state() == {"index": 5}
    source.load_state({"index": 1})
    assert source.next_batch(1) == [{"i": 1}]
    with pytest.raises(ValueError):
        source.load_state({"index": -1})


@pytest.fixture
def s3_endpoint(monkeypatch):
    import moto.server as moto_server

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    yield f"http://{host}:{port}"
    server.stop()


def test_static_source_reads_parquet_from_s3(tmp_path, s3_endpoint):
    import s3fs

    options = {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("flowrl-data")
    fs.put(_write_parquet(tmp_path / "rows.parquet", ROWS), "flowrl-data/train/rows.parquet")

    uri = "s3://flowrl-data/train/rows.parquet"
    source = StaticSource.from_uri(uri, seed=5, storage_options=options)
    assert source.next_batch(20) == StaticSource(ROWS, seed=5).next_batch(20)
    with pytest.raises(FileNotFoundError, match="s3://flowrl-data/missing.jsonl"):
        load_rows("s3://flowrl-data/missing.jsonl", storage_options=options)
