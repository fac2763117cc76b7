"""The tiny LLaVA built offline and images through the workers: a standard HF folder with its
processor, the chat format's image tokens, and the central invariant with images — after a
weight sync the sampler's log-probs of what it sampled equal the trainer's."""

from __future__ import annotations

import contextlib
import io
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.agent_loop.types import Trajectory
from flowrl.backends.engines.hf_sampler import HFSampler
from flowrl.backends.engines.torch_trainer import TorchTrainer
from flowrl.backends.models.chat import HFChatFormat
from flowrl.backends.models.model_folder import load_causal_lm, load_tokenizer
from flowrl.backends.models.tiny_model import (
    IMAGE_TOKEN,
    TinyModelSpec,
    TinyVisionSpec,
    build_tiny_model,
    build_tokenizer,
)
from flowrl.backends.models.vlm import ImageInputs, image_seq_length
from flowrl.backends.policy.actors import sampler, start_policy, stop_policy, sync_weights, trainer
from flowrl.backends.types import Datum, WorkerSpec
from flowrl.environments.geometry import GeometryTask
from flowrl.infra.storage import Storage
from flowrl.tasks.records import load_data, load_trajectories, save_data, save_trajectories
from flowrl.tasks.sft import sft_datum

torch.set_num_threads(1)

SPEC = TinyModelSpec(vision=TinyVisionSpec(enabled=True, image_size=32, patch_size=8))
IMAGE_TOKENS = (32 // 8) ** 2  # "default" strategy: patch features, CLS dropped
_names = itertools.count()


def png(color: str, size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(SPEC, str(tmp_path_factory.mktemp("tiny-vlm")))


@pytest.fixture(scope="module")
def chat(vlm_dir: str) -> HFChatFormat:
    return HFChatFormat(
        load_tokenizer(vlm_dir), sanitize_control_tokens=True, image_seq_length=IMAGE_TOKENS
    )


@pytest.fixture
def policy(vlm_dir: str, tmp_path: Path):
    refs = []

    def start(**fields):
        spec = WorkerSpec(model_uri=vlm_dir, cache_dir=str(tmp_path / "cache"), **fields)
        refs.append(start_policy(f"test-vlm-{next(_names)}", spec, local=True))
        return refs[-1]

    yield start
    for ref in refs:
        stop_policy(ref)


def image_message(text: str, n_images: int = 1) -> dict:
    return {
        "role": "user",
        "content": [*[{"type": "image"}] * n_images, {"type": "text", "text": text}],
    }


# --- the model folder -------------------------------------------------------------------------


def test_tiny_llava_is_a_standard_hf_folder_with_its_processor(vlm_dir, tmp_path):
    processor = AutoProcessor.from_pretrained(vlm_dir)
    assert type(processor).__name__ == "LlavaProcessor"
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"  # no torchvision
    inputs = processor(
        text=f"{IMAGE_TOKEN}Find x.",
        images=[Image.open(io.BytesIO(png("red")))],
        return_tensors="pt",
    )
    assert inputs["pixel_values"].shape == (1, 3, 32, 32)
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == IMAGE_TOKENS
    assert image_seq_length(vlm_dir) == IMAGE_TOKENS

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert type(load_causal_lm(vlm_dir)) is type(model)
    with torch.no_grad():
        logits = model(**inputs).logits
    model.save_pretrained(tmp_path / "resaved")
    processor.save_pretrained(tmp_path / "resaved")
    again = AutoModelForImageTextToText.from_pretrained(tmp_path / "resaved").eval()
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, logits)

    # Same spec, same weights; the text tokenizer's ids are unchanged, <image> comes last.
    rebuilt = build_tiny_model(SPEC, str(tmp_path / "rebuilt"))
    first, second = (
        load_file(f"{vlm_dir}/model.safetensors"),
        load_file(f"{rebuilt}/model.safetensors"),
    )
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    vocab, text_vocab = load_tokenizer(vlm_dir).get_vocab(), build_tokenizer().get_vocab()
    assert {k: v for k, v in vocab.items() if k != IMAGE_TOKEN} == text_vocab
    assert vocab[IMAGE_TOKEN] == len(text_vocab)


def test_chat_format_expands_images_exactly_as_the_processor_does(vlm_dir, chat):
    messages = [image_message("Find x. <image> is text here")]
    ids = chat.encode_prompt(messages)
    image_id = chat.image_token_id
    assert ids.count(image_id) == IMAGE_TOKENS  # the typed "<image>" stays characters
    # The processor's own expansion of the rendered chat gives the same ids.
    plain = [image_message("Find x.")]
    text = load_tokenizer(vlm_dir).apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True
    )
    processor = AutoProcessor.from_pretrained(vlm_dir)
    expanded = processor(text=text, images=[Image.new("RGB", (32, 32))])["input_ids"][0]
    assert chat.encode_prompt(plain) == list(expanded)


def test_a_text_only_model_refuses_image_messages(tmp_path):
    text_dir = build_tiny_model(TinyModelSpec(), str(tmp_path / "text"))
    assert image_seq_length(text_dir) == 0
    with pytest.raises(ValueError, match="reads text only"):
        HFChatFormat(load_tokenizer(text_dir)).encode_prompt([image_message("Find x.")])


# --- workers ----------------------------------------------------------------------------------


def batch(chat: HFChatFormat) -> tuple[list[list[int]], list[list[bytes]]]:
    """Three prompts: one image, two images (different sizes), and text only."""
    prompts = [
        chat.encode_prompt([image_message("Find x.")]),
        chat.encode_prompt([image_message("Two figures: which is larger?", 2)]),
        chat.encode_prompt([{"role": "user", "content": "No figure."}]),
    ]
    images = [[png("red")], [png("blue", (64, 64)), png("green", (20, 50))], []]
    return prompts, images


def as_data(prompts, images, results, advantage=0.0) -> list[Datum]:
    return [
        Datum(
            p + r.tokens,
            [0] * len(p) + [1] * len(r.tokens),
            advantage,
            [0.0] * len(p) + r.logprobs,
            imgs,
        )
        for p, imgs, r in zip(prompts, images, results, strict=True)
    ]


def assert_match(ref, prompts, images, temperature):
    results = sampler(ref).sample(prompts, 8, temperature, seed=3, images=images)
    at = temperature if temperature > 0 else 1.0
    rows = trainer(ref).compute_logprobs(as_data(prompts, images, results), at)
    for prompt, result, row in zip(prompts, results, rows, strict=True):
        assert len(result.tokens) == len(result.logprobs) > 0
        expected = torch.tensor(row[len(prompt) :])
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-5, rtol=0)
    return results


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0], ids=["sampled", "cooled", "greedy"])
def test_sampler_logprobs_match_trainer_with_images(policy, chat, temperature):
    ref = policy(learning_rate=1e-2)
    prompts, images = batch(chat)
    results = assert_match(ref, prompts, images, temperature)

    data = as_data(prompts, images, results, advantage=1.0)
    before = sum(sum(r) for r in trainer(ref).compute_logprobs(data))
    trainer(ref).forward_backward(data, "ppo_clip")
    assert trainer(ref).optim_step()["grad_norm"] > 0  # gradients flow with pixel_values
    assert sum(sum(r) for r in trainer(ref).compute_logprobs(data)) > before
    sync_weights(ref)
    assert_match(ref, prompts, images, 1.0)


def test_the_figure_changes_what_the_model_predicts(policy, chat):
    ref = policy()
    prompt = chat.encode_prompt([image_message("Find x.")])
    red, blue = (
        sampler(ref).sample([prompt], 4, 0.0, images=[[png(c)]])[0] for c in ("red", "blue")
    )
    assert red.logprobs != blue.logprobs


def test_the_image_token_is_never_sampled(vlm_dir, chat, tmp_path):
    """Even a model that prefers <image> above all never emits it (the policy excludes it)."""
    spec = WorkerSpec(model_uri=vlm_dir, cache_dir=str(tmp_path))
    workers = [HFSampler(spec), TorchTrainer(spec)]
    image_id = chat.image_token_id

    def prefer_image(_module, _inputs, logits):
        logits[..., image_id] += 100.0
        return logits

    for worker in workers:
        worker.model.lm_head.register_forward_hook(prefer_image)
    prompts, images = batch(chat)
    results = workers[0].sample(prompts, 8, 1.0, seed=0, images=images)
    assert all(image_id not in r.tokens and len(r.tokens) > 0 for r in results)
    rows = workers[1].compute_logprobs(as_data(prompts, images, results))
    for prompt, result, row in zip(prompts, results, rows, strict=True):
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(row[len(prompt) :]), atol=1e-5, rtol=0
        )
        assert all(torch.isfinite(torch.tensor(row)))


def test_export_keeps_the_processor_so_the_policy_reloads_as_a_vlm(policy, tmp_path):
    ref = policy()
    uri = trainer(ref).export_pretrained(str(tmp_path / "storage"), "policy")
    folder = uri.removeprefix("file://")
    assert (Path(folder) / "processor_config.json").is_file()
    assert image_seq_length(folder) == IMAGE_TOKENS
    assert ImageInputs(folder).pixel_values([png("red")]).shape == (1, 3, 32, 32)
    assert type(load_causal_lm(folder)).__name__ == "LlavaForConditionalGeneration"


# --- a geometry episode end to end, SFT data and records ----------------------------------------


class SeededSampler:
    def __init__(self, ref):
        self.worker = sampler(ref)

    def sample(self, prompts, max_new_tokens, temperature, images=None):
        return self.worker.sample(prompts, max_new_tokens, temperature, seed=1, images=images)


def test_geometry_episode_trains_on_exactly_the_sampled_tokens(policy, chat, tmp_path):
    ref = policy()
    task = GeometryTask(image_size=48)
    rows = task.train_source().next_batch(3)
    limits = LoopLimits(max_new_tokens=5, max_context_tokens=200, temperature=1.0)
    worker = SeededSampler(ref)
    trajectories = run_episodes(
        [task.make_env() for _ in rows], rows, [0, 1, 2], worker, chat, limits
    )

    for traj, row in zip(trajectories, rows, strict=True):
        assert traj.images == row["images"]
        prompt = traj.tokens[: traj.prompt_len]
        assert prompt == chat.encode_prompt([traj.messages[0]])
        assert prompt.count(chat.image_token_id) == IMAGE_TOKENS
        assert set(traj.loss_mask[: traj.prompt_len]) == {0}  # image tokens are injected
        assert set(traj.loss_mask[traj.prompt_len :]) == {1}
        assert traj.info["correct"] == (traj.reward == 1.0)

    data = [Datum(t.tokens, t.loss_mask, 0.0, t.logprobs, t.images) for t in trajectories]
    storage = Storage(str(tmp_path))
    with _records_to_storage():
        save_trajectories(storage, "t.json", trajectories)
        save_data(storage, "d.json", data)
    assert load_trajectories(storage, "t.json") == trajectories  # images survive as base64
    assert load_data(storage, "d.json") == data
    for traj, row in zip(trajectories, trainer(ref).compute_logprobs(data), strict=True):
        trained = range(traj.prompt_len, len(traj.tokens))
        torch.testing.assert_close(
            torch.tensor([row[i] for i in trained]),
            torch.tensor([traj.logprobs[i] for i in trained]),
            atol=1e-5,
            rtol=0,
        )


def test_warmup_sft_on_figures_lowers_the_loss(policy, chat):
    ref = policy(learning_rate=3e-3)
    task = GeometryTask(kinds=["complement"], num_choices=0, image_size=32)
    data = [sft_datum(chat, task.sft_example(row)) for row in task.train_source().next_batch(8)]
    losses = []
    for _ in range(5):
        losses.append(trainer(ref).forward_backward(data, "cross_entropy")["loss"])
        trainer(ref).optim_step()
    assert losses[-1] < losses[0] - 0.5


def test_sft_datum_carries_the_images_in_the_agent_loops_layout(chat):
    task = GeometryTask(image_size=48)
    row = task.problem(0)
    datum = sft_datum(chat, task.sft_example(row))
    assert datum.images == row["images"]
    env = task.make_env()
    prompt = chat.encode_prompt(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": env.reset(**row)}],
            }
        ]
    )
    answer = chat.tokenizer.encode(row["answer"], add_special_tokens=False) + chat.stop_token_ids
    assert datum.tokens == prompt + answer
    assert datum.loss_mask == [0] * len(prompt) + [1] * len(answer)


def test_trajectories_without_images_are_unchanged_on_disk(tmp_path):
    storage = Storage(str(tmp_path))
    plain = Trajectory("e", 0, tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -0.5])
    with _records_to_storage():
        save_trajectories(storage, "t.json", [plain])
    assert load_trajectories(storage, "t.json") == [plain]


@contextlib.contextmanager
def _records_to_storage() -> Iterator[None]:
    """Records saved meanwhile go to storage at once (as past the memory bound), so the
    loads read them back from their JSON."""
    from flowrl.tasks import records

    bound = records.MEMO_ENTRIES
    records.MEMO_ENTRIES = 0
    try:
        yield
    finally:
        records.MEMO_ENTRIES = bound
