"""Geometry: the Geometry3K-layout loader (local and S3), the synthetic problem generator, the
environment's scoring, and images through the agent loop (byte-level fakes, no model)."""

from __future__ import annotations

import io
import json
import math
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fakes import (
    ASSISTANT,
    END,
    IMAGE,
    IMAGE_TOKENS,
    USER,
    ByteChat,
    ScriptedSampler,
    say,
    text_ids,
)
from PIL import Image

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.environments.geometry import (
    GeometryEnv,
    GeometryTask,
    accepted_answers,
    load_geometry3k,
    save_geometry3k,
)
from flowrl.environments.geometry_figures import KINDS, answer_value, problem_space, render_png
from flowrl.environments.registry import make_task
from flowrl.environments.types import StepResult


def png(color: str, size: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


# --- loader -----------------------------------------------------------------------------------

RAW_ROWS = [
    {"problem": "<image>Find x.", "choices": ["3", "4", "5", "6"], "answer": "C", "img": "red"},
    {"problem": "Find the area.", "choices": [], "answer": "12", "img": "blue"},
]
IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def write_parquet(path: str, single_image: bool) -> None:
    """Geometry3K as HF datasets writes it: ``images`` a list of image structs, or ``image``
    one struct (the single-image variant)."""
    column = "image" if single_image else "images"
    cells = [{"bytes": png(r["img"]), "path": None} for r in RAW_ROWS]
    table = pa.table(
        {
            column: pa.array(
                cells if single_image else [[c] for c in cells],
                type=IMAGE_STRUCT if single_image else pa.list_(IMAGE_STRUCT),
            ),
            "problem": [r["problem"] for r in RAW_ROWS],
            "choices": pa.array([r["choices"] for r in RAW_ROWS], type=pa.list_(pa.string())),
            "answer": [r["answer"] for r in RAW_ROWS],
        }
    )
    pq.write_table(table, path)


@pytest.mark.parametrize("single_image", [False, True], ids=["images-list", "image-struct"])
def test_loader_reads_the_geometry3k_parquet_layout(tmp_path, single_image):
    path = str(tmp_path / "g3k.parquet")
    write_parquet(path, single_image)

    rows = load_geometry3k(path)

    assert [r["problem"] for r in rows] == [r["problem"] for r in RAW_ROWS]
    assert [r["choices"] for r in rows] == [r["choices"] for r in RAW_ROWS]
    assert [r["answer"] for r in rows] == ["C", "12"]
    assert [r["images"] for r in rows] == [[png("red")], [png("blue")]]


def test_loader_reads_image_paths_relative_to_the_file_and_names_bad_rows(tmp_path):
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "1.png").write_bytes(png("green"))
    good = {"image": {"bytes": None, "path": "figs/1.png"}, "problem": "p", "answer": "1"}
    (tmp_path / "g.jsonl").write_text(json.dumps(good) + "\n")
    assert load_geometry3k(str(tmp_path / "g.jsonl"))[0]["images"] == [png("green")]

    (tmp_path / "bad.jsonl").write_text(json.dumps({"problem": "no answer"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl.*row 0"):
        load_geometry3k(str(tmp_path / "bad.jsonl"))


@pytest.mark.parametrize(
    "cell",
    [
        "../secret.png",
        "figs/../../secret.png",
        "/etc/passwd",
        "~/secret.png",
        "file:///etc/passwd",
        "s3://other-bucket/secret.png",
        "http://127.0.0.1:9/secret.png",
        {"bytes": None, "path": "../secret.png"},
    ],
)
def test_a_path_cell_is_confined_to_the_data_files_folder(tmp_path, cell):
    """Path cells are read relative to the data file's own folder, and only there."""
    (tmp_path / "secret.png").write_bytes(png("red"))  # beside, not inside, the data folder
    data = tmp_path / "data"
    data.mkdir()
    row = {"image": cell, "problem": "p", "answer": "1"}
    (data / "g.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"g.jsonl.*row 0.*only a relative path inside"):
        load_geometry3k(str(data / "g.jsonl"))


@pytest.mark.parametrize(
    "image", ["/etc/passwd", "file:///etc/passwd", {"bytes": None, "path": "/etc/passwd"}, 3]
)
def test_an_episode_never_opens_a_path_or_url_from_its_row(image):
    with pytest.raises(ValueError, match="must be bytes"):
        GeometryEnv().reset(problem="p", answer="1", images=[image])
    env = GeometryEnv()
    env.reset(problem="p", answer="1", images=[png("blue"), {"bytes": png("red"), "path": None}])
    assert env.get_images() == [png("blue"), png("red")]


def test_task_reads_geometry3k_from_s3_with_a_disjoint_eval_split(moto_s3):
    task = GeometryTask(max_length=12, image_size=32, eval_size=10, seed=3)
    rows = task.eval_set() + task.train_source().next_batch(30)
    uri = f"{moto_s3.url}/geometry3k/train.parquet"
    save_geometry3k(rows, uri)

    remote = GeometryTask(data=uri, eval_size=5, seed=1)
    held_out = remote.eval_set()
    training = remote.train_source().next_batch(len(rows) - 5)  # one epoch

    assert len(held_out) == 5
    key = lambda r: (r["problem"], tuple(r["choices"]), r["images"][0])  # noqa: E731
    assert not {key(r) for r in held_out} & {key(r) for r in training}
    assert {key(r) for r in held_out} | {key(r) for r in training} == {key(r) for r in rows}
    assert held_out == GeometryTask(data=uri, eval_size=5, seed=1).eval_set()  # fixed by seed


# --- synthetic problems -----------------------------------------------------------------------


def expected_answer(kind: str, p: int, q: int) -> float:
    """The answer worked out from the figure's parameters, independently of the generator."""
    if kind == "hypotenuse":
        return math.hypot(p, q)
    if kind == "leg":
        return math.sqrt(p * p - q * q)
    if kind == "third_angle":
        return 180 - p - q
    if kind == "complement":
        return 90 - p
    if kind == "rectangle_area":
        return p * q
    return p * q / 2  # triangle_area


def test_synthetic_rows_are_deterministic_and_answers_are_exact():
    task = GeometryTask(image_size=48)
    for i in range(60):
        row = task.problem(i)
        p, q = row["params"]
        assert row["images"] == [render_png((row["kind"], p, q), 48)]  # a fresh render: same PNG
        assert GeometryTask(image_size=48, seed=0).problem(i)["choices"] == row["choices"]
        value = expected_answer(row["kind"], p, q)
        assert value == int(value) > 0, row["kind"]
        letter = row["answer"]
        assert row["choices"]["ABCD".index(letter)] == str(int(value))
        assert len(set(row["choices"])) == 4
        image = Image.open(io.BytesIO(row["images"][0]))
        assert image.size == (48, 48) and image.format == "PNG"
        assert len(image.getcolors(48 * 48)) > 1  # something is drawn


def test_every_kind_renders_and_the_eval_split_is_held_out_of_training():
    for kind in KINDS:
        key = problem_space((kind,), 20)[0]
        assert answer_value(key) > 0
        assert render_png(key, 32) == render_png(key, 32)
    task = GeometryTask(kinds=["complement"], num_choices=0, eval_size=20)
    held_out = {r["problem"] for r in task.eval_set()}
    training = {r["problem"] for r in task.train_source().next_batch(500)}
    assert len(held_out) == 20 and not held_out & training
    assert len(training) == 71 - 20  # the whole rest of the space shows up
    assert GeometryTask(kinds=["complement"], num_choices=0, eval_size=20, seed=1).eval_set() != (
        task.eval_set()
    )


def test_bad_parameters_fail_naming_the_field():
    with pytest.raises(ValueError, match="eval_size"):
        make_task("geometry", {"kinds": ["hypotenuse"], "max_length": 5, "eval_size": 2})
    with pytest.raises(ValueError, match="kinds"):
        make_task("geometry", {"kinds": ["pentagon"]})


# --- environment ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "correct"),
    [
        ("C", True),
        ("c", True),
        ("(C)", True),
        ("C.", True),
        (" 5 ", True),
        ("5.0", True),
        ("B", False),
        ("4", False),
        ("", False),
        ("C5", False),
    ],
)
def test_env_accepts_the_letter_or_the_value(action, correct):
    env = GeometryEnv()
    shown = env.reset(
        problem="<image>Find x.", answer="C", images=[png("red")], choices=["3", "4", "5", "6"]
    )
    assert shown == "Find x.\nA)3 B)4 C)5 D)6"
    assert env.get_images() == [png("red")]
    result = env.step(action)
    assert result == StepResult("", float(correct), True, {"correct": correct})


def test_value_answers_also_accept_their_letter():
    assert accepted_answers("12", ["10", "12"]) == {"12", "b"}
    assert accepted_answers("2\\sqrt{3}", []) == {"2\\sqrt{3}"}


# --- images through the agent loop (fakes) ----------------------------------------------------


class TwoFigureEnv(GeometryEnv):
    """Multi-turn: a wrong first answer gets a hint with a second figure."""

    def step(self, action):
        if action.strip() == "wrong":
            self._images = [png("blue")]
            return StepResult("hint", 0.0, False, {})
        return super().step(action)


def test_images_reach_the_sampler_and_their_tokens_are_injected_with_mask_zero():
    rows = [
        {"problem": "Find x.", "answer": "5", "images": [png("red")], "choices": []},
        {"problem": "Find y.", "answer": "7", "images": [], "choices": []},
    ]
    sampler = ScriptedSampler([[say("wrong"), say("7")], [say("5")]])
    chat = ByteChat()

    first, text_only = run_episodes(
        [TwoFigureEnv(), TwoFigureEnv()], rows, [0, 1], sampler, chat, LoopLimits(max_turns=2)
    )

    assert sampler.calls[0]["images"] == [[png("red")], []]
    assert sampler.calls[1]["images"] == [[png("red"), png("blue")]]
    prompt = [USER, *[IMAGE] * IMAGE_TOKENS, *text_ids("Find x."), END, ASSISTANT]
    hint = [USER, *[IMAGE] * IMAGE_TOKENS, *text_ids("hint"), END, ASSISTANT]
    assert first.tokens == prompt + say("wrong") + hint + say("5")
    assert first.loss_mask == [0] * len(prompt) + [1] * 6 + [0] * len(hint) + [1] * 2
    trained = [t for t, m in zip(first.tokens, first.loss_mask, strict=True) if m]
    assert trained == say("wrong") + say("5")  # exactly the sampled tokens
    assert first.images == [png("red"), png("blue")]
    assert first.tokens.count(IMAGE) == IMAGE_TOKENS * len(first.images)
    assert first.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Find x."}]
    assert first.turn_rewards == [0.0, 1.0] and text_only.reward == 1.0
    assert text_only.images == [] and text_only.messages[0]["content"] == "Find y."
    assert pickle.loads(pickle.dumps(first)) == first


def test_text_only_episodes_call_the_sampler_without_images():
    class TextOnlySampler(ScriptedSampler):
        def sample(self, prompts, max_new_tokens, temperature):  # no images parameter
            return super().sample(prompts, max_new_tokens, temperature)

    sampler = TextOnlySampler([[say("5")]])
    row = {"problem": "Find x.", "answer": "5", "images": [], "choices": []}
    (traj,) = run_episodes([GeometryEnv()], [row], [0], sampler, ByteChat(), LoopLimits())
    assert traj.reward == 1.0 and traj.images == [] and sampler.calls[0]["images"] is None
