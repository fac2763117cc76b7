"""The model workers' verbs on a tiny model: weight sync, updates, seeding, resume, LoRA, Ray.

Most tests run the sampler and trainer in-process (``start_policy(local=True)``); one test
runs them as named Ray actors. The central invariant: after a weight sync the sampler's
log-probs of what it sampled equal the trainer's log-probs of the same sequences.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from flowrl.agent_loop.types import SampleResult
from flowrl.backends.engines import torch_trainer
from flowrl.backends.engines.passes import cpu_tokens_per_pass, split_passes
from flowrl.backends.models.chat import HFChatFormat
from flowrl.backends.models.model_folder import load_causal_lm, load_tokenizer
from flowrl.backends.policy.actors import (
    PolicyRef,
    sampler,
    start_policy,
    stop_policy,
    sync_weights,
    trainer,
)
from flowrl.backends.types import Datum, LoraSettings, WorkerSpec
from flowrl.infra.storage import Storage, latest_checkpoint

torch.set_num_threads(1)

MAX_NEW_TOKENS = 12
LORA = LoraSettings(enabled=True, r=4, alpha=8)
_names = itertools.count()


@pytest.fixture
def policy(model_dir: str, tmp_path: Path) -> Iterator[Callable[..., PolicyRef]]:
    """Start in-process policies (``policy(lora=..., learning_rate=...)``); stopped afterwards."""
    refs: list[PolicyRef] = []

    def start(**spec_fields) -> PolicyRef:
        spec = WorkerSpec(model_uri=model_dir, cache_dir=str(tmp_path / "cache"), **spec_fields)
        refs.append(start_policy(f"test-workers-{next(_names)}", spec, local=True))
        return refs[-1]

    yield start
    for ref in refs:
        stop_policy(ref)


def as_data(prompts: list[list[int]], results: list[SampleResult], advantage: float = 0.0):
    """Prompt + completion per row; loss and the sampler's log-probs on the completion only."""
    return [
        Datum(
            tokens=p + r.tokens,
            loss_mask=[0] * len(p) + [1] * len(r.tokens),
            advantage=advantage,
            old_logprobs=[0.0] * len(p) + r.logprobs,
        )
        for p, r in zip(prompts, results, strict=True)
    ]


def assert_sampler_matches_trainer(
    ref: PolicyRef, prompts: list[list[int]], temperature: float, seed: int = 0
) -> list[SampleResult]:
    results = sampler(ref).sample(prompts, MAX_NEW_TOKENS, temperature, seed=seed)
    # Greedy log-probs are reported at temperature 1; sampled ones at the sampling temperature.
    at = temperature if temperature > 0 else 1.0
    trainer_logprobs = trainer(ref).compute_logprobs(as_data(prompts, results), at)
    for prompt, result, row in zip(prompts, results, trainer_logprobs, strict=True):
        assert len(result.tokens) == len(result.logprobs) > 0
        expected = torch.tensor(row[len(prompt) :])
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-5, rtol=0)
    return results


def update(ref: PolicyRef, data: list[Datum]) -> dict[str, float]:
    trainer(ref).forward_backward(data, "ppo_clip")
    return trainer(ref).optim_step()


def mean_logprob(ref: PolicyRef, prompts: list[list[int]], data: list[Datum]) -> float:
    """The trainer's log-prob of each completion (summed over its tokens), averaged over rows."""
    rows = trainer(ref).compute_logprobs(data)
    return sum(sum(row[len(p) :]) for p, row in zip(prompts, rows, strict=True)) / len(rows)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0], ids=["sampled", "cooled", "greedy"])
def test_sampler_logprobs_match_trainer_after_sync(policy, prompts, temperature):
    ref = policy()
    assert sync_weights(ref) == 0
    assert_sampler_matches_trainer(ref, prompts, temperature)


def test_policy_gradient_step_then_sync_moves_sampler_and_keeps_the_match(policy, prompts):
    ref = policy()
    before = sampler(ref).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=3)
    data = as_data(prompts, before, advantage=1.0)
    logprob_before = mean_logprob(ref, prompts, data)
    assert update(ref, data)["weights_version"] == 1
    # A positive advantage makes the sampled completions more likely under the trainer ...
    assert mean_logprob(ref, prompts, data) > logprob_before + 0.1
    # ... while the sampler keeps the old weights until the sync.
    stale = sampler(ref).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=3)
    assert [r.logprobs for r in stale] == [r.logprobs for r in before]
    assert sync_weights(ref) == 1 and sampler(ref).get_weights_version() == 1
    after = assert_sampler_matches_trainer(ref, prompts, 1.0, seed=3)
    # Same seed; a completion may end earlier or later now, so compare the common prefix.
    pairs = [zip(r.logprobs, s.logprobs, strict=False) for r, s in zip(after, before, strict=True)]
    assert max(abs(a - b) for pair in pairs for a, b in pair) > 1e-3


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(policy, prompts):
    ref = policy()
    sample = sampler(ref).sample
    first, again = (sample(prompts, MAX_NEW_TOKENS, 1.0, seed=7) for _ in range(2))
    assert first == again
    assert [r.tokens for r in sample(prompts, MAX_NEW_TOKENS, 1.0, seed=8)] != [
        r.tokens for r in first
    ]
    greedy = [sample(prompts, MAX_NEW_TOKENS, 0.0, seed=s) for s in (None, 1, 2)]
    assert greedy[0] == greedy[1] == greedy[2]


def test_a_group_sharing_its_prompt_prefills_it_once_and_samples_the_same(
    policy, prompts, monkeypatch
):
    """Rows that repeat a prompt (a GRPO group) reuse one prefilled KV cache: the samples and
    their log-probs are those of prefilling every row, and still match the trainer's."""
    from flowrl.backends.engines import hf_sampler

    ref = policy()
    grouped = [p for p in prompts for _ in range(4)]
    prefilled: list[int] = []  # rows prefilled ahead of generate, per sample call
    shared_cache = hf_sampler._shared_prompt_cache

    def counted(model, ids, attention):
        forward = model.forward

        def spy(*args, **kwargs):
            prefilled.append(len(kwargs["input_ids"]))
            return forward(*args, **kwargs)

        model.forward = spy
        try:
            return shared_cache(model, ids, attention)
        finally:
            del model.forward

    monkeypatch.setattr(hf_sampler, "_shared_prompt_cache", counted)
    shared = sampler(ref).sample(grouped, MAX_NEW_TOKENS, 1.0, seed=5)
    sampler(ref).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=5)
    assert prefilled == [3]  # 3 distinct prompts once; distinct prompts are not prefilled apart
    monkeypatch.setattr(hf_sampler, "_shared_prompt_cache", lambda *a: {})
    full = sampler(ref).sample(grouped, MAX_NEW_TOKENS, 1.0, seed=5)
    assert [r.tokens for r in shared] == [r.tokens for r in full]
    for a, b in zip(shared, full, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
    rows = trainer(ref).compute_logprobs(as_data(grouped, shared))
    for prompt, result, row in zip(grouped, shared, rows, strict=True):
        expected = torch.tensor(row[len(prompt) :])
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-5, rtol=0)


def test_a_group_sharing_its_prompt_is_trained_on_one_pass_of_it_with_the_same_gradients(
    policy, prompts, monkeypatch
):
    """The trainer runs a prompt its rows repeat once (KV cache copied to the rows): the loss,
    the log-probs against the sampler's and every gradient equal those of running each row
    in full, for a policy loss and for SFT's cross-entropy."""
    from flowrl.backends.engines import torch_trainer

    ref = policy()
    grouped = [p for p in prompts for _ in range(4)]
    results = sampler(ref).sample(grouped, MAX_NEW_TOKENS, 1.0, seed=11)
    data = as_data(grouped, results)
    data = [Datum(d.tokens, d.loss_mask, (-1.0) ** i, d.old_logprobs) for i, d in enumerate(data)]
    model = trainer(ref)._target.model
    rows_run: list[int] = []
    forward = model.forward

    def spy(*args, **kwargs):
        rows_run.append(int(kwargs["input_ids"].numel()))
        return forward(*args, **kwargs)

    def step(loss_fn: str) -> tuple[dict[str, float], list[torch.Tensor]]:
        metrics = trainer(ref).forward_backward(data, loss_fn)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return metrics, grads

    for loss_fn in ("ppo_clip", "cross_entropy"):
        rows_run.clear()
        model.forward = spy
        try:
            shared, shared_grads = step(loss_fn)
        finally:
            del model.forward
        full_tokens = sum(len(d.tokens) for d in data)
        assert len(rows_run) == 2 and sum(rows_run) < full_tokens  # prefixes once, then the rest
        with monkeypatch.context() as m:
            m.setattr(torch_trainer, "_shared_prefix_logprobs", lambda *a: None)
            full, full_grads = step(loss_fn)
        assert shared.keys() == full.keys()
        for key in shared:
            assert shared[key] == pytest.approx(full[key], abs=1e-5), key
        for a, b in zip(shared_grads, full_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert full["loss"] != 0.0


@pytest.mark.parametrize(
    "loss_fn,loss_agg",
    [("ppo_clip", "token-mean"), ("gspo", None), ("cispo", "seq-mean-token-sum")],
    ids=["ppo-token-mean", "gspo-its-default", "cispo-seq-sum"],
)
def test_rows_of_advantage_zero_skip_the_passes_and_leave_loss_and_gradients_as_they_were(
    policy, prompts, loss_fn, loss_agg
):
    """A GRPO group whose samples all scored the same has advantage 0: its rows add nothing to
    the policy loss or its gradient. The trainer leaves them out of the forward and backward
    passes (fewer rows run) and rescales the rest: loss and every gradient are those of the
    whole batch; a batch of only such rows still gives AdamW zero gradients to step on."""
    ref = policy()
    grouped = [p for p in prompts for _ in range(4)]
    results = sampler(ref).sample(grouped, MAX_NEW_TOKENS, 1.0, seed=5)
    data = as_data(grouped, results)
    # the first prompt's group all alike (advantage 0); the others' mixed
    data = [
        Datum(d.tokens, d.loss_mask, 0.0 if i < 4 else (-1.0) ** i * (1 + i % 3), d.old_logprobs)
        for i, d in enumerate(data)
    ]
    model = trainer(ref)._target.model
    forward = model.forward
    rows_run: list[int] = []

    def spy(*args, **kwargs):
        rows_run.append(int(kwargs["input_ids"].shape[0]))
        return forward(*args, **kwargs)

    def step(rows: list[Datum], skip: bool) -> tuple[dict[str, float], list[torch.Tensor]]:
        config = {"skip_zero_advantage": skip} | ({"loss_agg": loss_agg} if loss_agg else {})
        rows_run.clear()
        model.forward = spy
        try:
            metrics = trainer(ref).forward_backward(rows, loss_fn, config)
        finally:
            del model.forward
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return metrics, grads

    skipped, skipped_grads = step(data, skip=True)
    ran = list(rows_run)
    whole, whole_grads = step(data, skip=False)
    assert max(ran) == len(data) - 4 < max(rows_run)  # the alike group never ran
    assert skipped["zero_advantage_rows"] == pytest.approx(4 / len(data))
    assert skipped["loss"] == pytest.approx(whole["loss"], rel=1e-5) and whole["loss"] != 0.0
    for a, b in zip(skipped_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

    alike = [Datum(d.tokens, d.loss_mask, 0.0, d.old_logprobs) for d in data]
    metrics, grads = step(alike, skip=True)
    assert rows_run == [] and metrics == {"loss": 0.0, "zero_advantage_rows": 1.0}
    assert all(bool((g == 0).all()) for g in grads)


@pytest.mark.parametrize(
    "loss_fn,config",
    [
        ("ppo_clip", {"loss_agg": "token-mean"}),
        ("cispo", {"loss_agg": "seq-mean-token-sum"}),
        ("gspo", {}),
        ("ppo_clip", {"kl_coef": 0.1}),
        ("cross_entropy", {}),
    ],
    ids=["ppo-token-mean", "cispo-seq-sum", "gspo-its-default", "ppo-with-kl", "sft"],
)
def test_an_update_in_passes_has_the_loss_and_gradients_of_one_pass(
    policy, prompts, monkeypatch, loss_fn, config
):
    """On a CPU a trainer runs a large batch in several forward and backward passes of at most
    ``passes.cpu_tokens_per_pass`` padded tokens, so that its peak memory is a pass's activations:
    the loss, every gradient and the token-mean metrics are the whole batch's, whatever the
    loss's aggregation, with a KL term, with rows of advantage 0 left out, and for SFT."""
    ref = policy()
    grouped = [p for p in prompts for _ in range(4)]
    data = as_data(grouped, sampler(ref).sample(grouped, MAX_NEW_TOKENS, 1.0, seed=3))
    data = [  # the first group alike (advantage 0), the others mixed
        Datum(d.tokens, d.loss_mask, 0.0 if i < 4 else (-1.0) ** i * (1 + i % 3), d.old_logprobs)
        for i, d in enumerate(data)
    ]
    target = trainer(ref)._target
    model = target.model
    split = torch_trainer.split_passes
    runs: list[list[Datum]] = []

    def update(tokens: int) -> tuple[dict[str, float], list[torch.Tensor]]:
        runs.clear()
        with monkeypatch.context() as m:
            m.setattr(torch_trainer, "cpu_tokens_per_pass", lambda model: tokens)
            m.setattr(torch_trainer, "split_passes", lambda *a: runs.extend(split(*a)) or runs)
            metrics = target.forward_backward(data, loss_fn, config)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return metrics, grads

    whole, whole_grads = update(10**9)
    assert len(runs) == 1
    widest = max(len(d.tokens) for d in data)
    passes, passes_grads = update(3 * widest)  # 3 rows of the widest a pass
    assert len(runs) > 1 and all(len(r) * max(len(d.tokens) for d in r) <= 3 * widest for r in runs)
    assert whole.keys() == passes.keys()
    assert passes["loss"] == pytest.approx(whole["loss"], rel=1e-5) and whole["loss"] != 0.0
    for a, b in zip(passes_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    if config.get("loss_agg") == "token-mean":  # token means: the whole batch's
        for key in whole:
            assert passes[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize(
    "hidden,layers,mlp,rows,width,passes",
    [(128, 2, 256, 512, 11, 1), (256, 4, 688, 80, 41, 2), (768, 12, 2560, 32, 30, 1)],
    ids=["tiny-one-pass", "3m-two-passes", "100m-one-pass"],
)
def test_a_cpu_update_splits_where_its_activations_outweigh_the_trainers_state(
    hidden, layers, mlp, rows, width, passes
):
    """The benchmark's sizes as measured (``passes.PASS_MEMORY_CPU``): the default job's
    update stays one pass (more passes only cost time), the ~3M one runs in two (its
    activations are most of the worker's peak), the ~100M one stays one pass (its weights,
    gradients and AdamW state outweigh its activations; each pass would read the weights
    again)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=mlp,
        vocab_size=104,
    )
    with torch.device("meta"):  # shapes only
        model = LlamaForCausalLM(config)
    tokens = cpu_tokens_per_pass(model)
    assert len(split_passes([Datum([1] * width, [1] * width, 1.0)] * rows, tokens)) == passes


def test_passes_hold_consecutive_rows_within_the_token_budget():
    rows = [Datum([1] * n, [1] * n, 1.0) for n in (4, 6, 5, 20, 3, 3)]
    passes = split_passes(rows, 12)
    assert [r for p in passes for r in p] == rows  # every row once, in order
    assert all(len(p) * max(len(d.tokens) for d in p) <= 12 or len(p) == 1 for p in passes)
    assert [len(p) for p in passes] == [2, 1, 1, 2]  # 4+6 → 2×6; 5 alone; 20 alone; 3, 3
    assert split_passes(rows, None) == [rows]


def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(policy, prompts, tmp_path):
    url, prefix = str(tmp_path / "store"), "job/checkpoints"
    ref = policy()
    data = as_data(prompts, sampler(ref).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=0), 1.0)
    update(ref, data)
    uri = trainer(ref).save_state(url, prefix, 1, {"job": "resume-test"})
    assert uri.endswith("step-00000001") and latest_checkpoint(Storage(url), prefix) == 1
    saved_weights, saved_rng = trainer(ref).get_weights()[0], torch.get_rng_state()
    update(ref, data)  # the uninterrupted run's step 2
    expected = trainer(ref).get_weights()[0]
    update(ref, data)  # one more, so a rewind has something to undo
    torch.rand(3)  # and move the RNG on

    # Rewind the same trainer, then resume in a fresh one (a restarted job).
    for resumed in (ref, policy()):
        meta = trainer(resumed).load_state(url, prefix)
        assert meta["step"] == 1 and meta["job"] == "resume-test" and meta["weights_version"] == 1
        assert torch.equal(torch.get_rng_state(), saved_rng)
        weights = trainer(resumed).get_weights()[0]
        assert all(torch.equal(weights[k], v) for k, v in saved_weights.items())
        assert update(resumed, data)["weights_version"] == 2
        weights = trainer(resumed).get_weights()[0]
        assert all(torch.equal(weights[k], v) for k, v in expected.items())  # optimiser too

    trainer(ref).save_state(url, prefix, 2, {})
    assert latest_checkpoint(Storage(url), prefix) == 2


def test_lora_trains_only_the_adapter_checkpoints_it_small_and_exports_merged(
    policy, prompts, tmp_path
):
    url = str(tmp_path / "store")
    ref, full = policy(lora=LORA, learning_rate=1e-2), policy()
    live = trainer(ref).model
    trainable = [n for n, p in live.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    data = as_data(prompts, sampler(ref).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=0), 1.0)
    update(ref, data)
    trainer(ref).save_state(url, "lora", 1, {})
    trainer(full).save_state(url, "full", 1, {})
    storage = Storage(url)
    adapter = load_safetensors(storage.read_bytes("lora/step-00000001/weights.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    lora_size = storage.sizes("lora/step-00000001")["weights.safetensors"]
    full_size = storage.sizes("full/step-00000001")["weights.safetensors"]
    print(f"weights.safetensors: LoRA r=4 {lora_size} B, full model {full_size} B")
    assert full_size > 10 * lora_size

    adapter_before = trainer(ref).get_weights()[0]
    folder = trainer(ref).export_pretrained(url, "export/policy").removeprefix("file://")
    names = {p.name for p in Path(folder).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(n.startswith("adapter_") for n in names)
    probe = torch.tensor([prompts[1] + data[1].tokens[len(prompts[1]) :]])
    with torch.no_grad():
        exported, merged_live = load_causal_lm(folder)(probe).logits, live(probe).logits
        base = trainer(full).model(probe).logits
    torch.testing.assert_close(exported, merged_live, atol=1e-4, rtol=0)
    assert (exported - base).abs().max() > 1e-2  # the adapter did change the policy
    after = trainer(ref).get_weights()[0]
    assert all(torch.equal(after[k], v) for k, v in adapter_before.items())  # live one untouched

    assert sync_weights(ref) == 1
    assert_sampler_matches_trainer(ref, prompts, 1.0)


@pytest.fixture
def ray_cluster(ray_local) -> None:
    """The session's Ray (conftest)."""


def test_ray_actors_sample_update_sync_restart_and_stop(
    ray_cluster, policy, model_dir, prompts, tmp_path
):
    """Ray actors sample, train and sync; restarted from another spec (warm-up hands its
    workers to the job so), each is built again in its own process and then samples and
    trains exactly as a worker started fresh with that spec."""
    import ray

    from flowrl.backends.policy.actors import restart_policy
    from flowrl.infra.settings import RAY_NAMESPACE as NAMESPACE

    spec = WorkerSpec(model_uri=model_dir, cache_dir=str(tmp_path / "cache"))
    ref = start_policy("test-workers-ray", spec, local=False, trainer_threads=2)

    def pids() -> dict[str, int]:
        handles = {n: ray.get_actor(n, namespace=NAMESPACE) for n in (ref.sampler, ref.trainer)}
        return {n: ray.get(h.where.remote())[1] for n, h in handles.items()}

    started = pids()
    # The trainer runs 2 torch threads, the sampler 1; idle OpenMP threads sleep, not spin.
    for name, threads in ((ref.sampler, "1"), (ref.trainer, "2")):
        environ = dict(
            v.split("=", 1)
            for v in Path(f"/proc/{started[name]}/environ").read_text().split("\0")
            if v
        )
        assert (environ["OMP_NUM_THREADS"], environ["OMP_WAIT_POLICY"]) == (threads, "PASSIVE")
    results = sampler(ref).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=0)
    assert update(ref, as_data(prompts, results, advantage=1.0))["weights_version"] == 1
    assert sync_weights(ref) == 1
    assert_sampler_matches_trainer(ref, prompts, 1.0)

    job = {"lora": LORA, "learning_rate": 1e-2, "seed": 5}
    assert restart_policy(ref, spec.model_copy(update=job), trainer_threads=2)
    assert pids() == started  # the same processes: no worker started
    assert sampler(ref).get_weights_version() == 0
    fresh = policy(**job)  # in-process, started from the same spec
    for r in (ref, fresh):
        assert sampler(r).get_weights_version() == 0 and sync_weights(r) == 0
    got = [sampler(r).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=1) for r in (ref, fresh)]
    assert [x.tokens for x in got[0]] == [x.tokens for x in got[1]]
    data = as_data(prompts, got[1], advantage=1.0)
    steps = [update(r, data) for r in (ref, fresh)]
    assert steps[0]["weights_version"] == steps[1]["weights_version"] == 1
    assert steps[0] == pytest.approx(steps[1], rel=1e-5, abs=1e-6)
    stop_policy(ref)
    for name in (ref.sampler, ref.trainer):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="flowrl")


def test_a_colocated_policy_is_one_process_that_samples_and_trains_as_two(
    ray_cluster, policy, model_dir, prompts, tmp_path
):
    """``colocate``: the sampler and the trainer in one actor process, each with its own torch
    threads; it samples and trains exactly as separate workers do, and restarts. Its sampler
    samples the trainer's own model: the weights of the last update at once, as separate
    workers do after a sync, which copies nothing here."""
    import ray

    from flowrl.backends.policy.actors import restart_policy
    from flowrl.infra.settings import RAY_NAMESPACE as NAMESPACE

    spec = WorkerSpec(model_uri=model_dir, cache_dir=str(tmp_path / "cache"), lora=LORA)
    ref = start_policy("test-colocated", spec, local=False, trainer_threads=2, colocate=True)
    apart = policy(lora=LORA)  # in-process, one worker per role
    try:
        assert ref.colocated and ref.actors == ("test-colocated-policy",)
        handle = ray.get_actor(ref.trainer, namespace=NAMESPACE)
        _, pid = ray.get(handle.where.remote())
        environ = Path(f"/proc/{pid}/environ").read_text().split("\0")
        assert "OMP_NUM_THREADS=2" in environ  # the larger of the two roles' threads
        # Its roles take turns on its cores: OpenMP's threads spin a moment between kernels
        # (its default) instead of sleeping at once as a worker beside others' threads does.
        assert not any(v.startswith("OMP_WAIT_POLICY=") for v in environ)
        got = [sampler(r).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=0) for r in (ref, apart)]
        assert [x.tokens for x in got[0]] == [x.tokens for x in got[1]]
        data = as_data(prompts, got[1], advantage=1.0)
        steps = [update(r, data) for r in (ref, apart)]
        assert steps[0] == pytest.approx(steps[1], rel=1e-5, abs=1e-6)
        assert sampler(ref).get_weights_version() == 1  # the trainer's weights, unsynced
        assert sampler(apart).get_weights_version() == 0  # a copy of its own waits for it
        stale = sampler(apart).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=1)
        assert sync_weights(apart) == 1
        got = [sampler(r).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=1) for r in (ref, apart)]
        assert [x.tokens for x in got[0]] == [x.tokens for x in got[1]]
        new, synced, old = ([lp for x in g for lp in x.logprobs] for g in (*got, stale))
        assert new == pytest.approx(synced, abs=1e-5) and new != pytest.approx(old, abs=1e-3)
        assert sync_weights(ref) == 1
        assert_sampler_matches_trainer(ref, prompts, 1.0)
        assert restart_policy(ref, spec.model_copy(update={"lora": LoraSettings()}))
        assert ray.get(handle.where.remote())[1] == pid and sync_weights(ref) == 0
        assert_sampler_matches_trainer(ref, prompts, 0.0)
    finally:
        stop_policy(ref)
    with pytest.raises(ValueError):
        ray.get_actor(ref.trainer, namespace=NAMESPACE)


def test_a_colocated_sampler_holds_no_copy_of_the_trainers_weights(model_dir, prompts, tmp_path):
    """A colocated policy's sampler is the trainer's own model, not a copy: at 99M parameters
    that is 0.4 GB less, and a sync that copies nothing (docs/benchmarks/field.md). It samples
    without the adapter's dropout while the trainer trains with it; weights set from elsewhere
    (an exported version) make it a copy of its own, leaving the trainer's as they were. In
    bf16 it is a bf16 cast of the trainer's weights (a LoRA adapter float32, as PEFT keeps it),
    synced by casting the trained weights across: it samples as a bf16 sampler loaded from
    disk and synced from the trainer's state does."""
    from flowrl.backends.engines.hf_sampler import HFSampler
    from flowrl.backends.engines.torch_trainer import TorchTrainer

    lora = LORA.model_copy(update={"dropout": 0.5})
    cache = str(tmp_path / "cache")
    spec = WorkerSpec(model_uri=model_dir, cache_dir=cache, lora=lora, dtype="float32")
    trainer = TorchTrainer(spec)
    follower = HFSampler.following(spec, trainer)
    assert follower is not None and follower.model is trainer.model and trainer.model.training
    results = follower.sample(prompts, MAX_NEW_TOKENS, 1.0, seed=0)
    trainer.forward_backward(as_data(prompts, results, advantage=1.0), "ppo_clip")
    trainer.optim_step()  # the adapter's B leaves 0: its dropout now shows
    assert follower.get_weights_version() == 1 and follower.catch_up() == 1
    twice = [follower.sample(prompts, MAX_NEW_TOKENS, 0.0) for _ in range(2)]
    assert [x.logprobs for x in twice[0]] == [x.logprobs for x in twice[1]]  # no dropout
    assert trainer.model.training  # the trainer's mode, as it was
    data = as_data(prompts, twice[0])
    assert trainer.compute_logprobs(data) != trainer.compute_logprobs(data)  # dropout

    before = {k: v.clone() for k, v in trainer.get_weights()[0].items()}
    follower.set_weights(({k: torch.zeros_like(v) for k, v in before.items()}, 7))
    assert follower.model is not trainer.model and follower.get_weights_version() == 7
    after = trainer.get_weights()[0]
    assert all(torch.equal(before[k], after[k]) for k in before)

    bf16 = spec.model_copy(update={"dtype": "bfloat16"})
    other = spec.model_copy(update={"seed": 1})  # another adapter init: other weights
    assert HFSampler.following(other, trainer) is None

    for settings in (LoraSettings(), LORA):  # in bf16: a cast of the trainer's weights
        cast = bf16.model_copy(update={"lora": settings})
        trainer = TorchTrainer(cast)
        follower, loaded = HFSampler.following(cast, trainer), HFSampler(cast)
        assert follower.model is not trainer.model
        assert {p.dtype for p in follower.model.parameters()} == {
            p.dtype for p in loaded.model.parameters()
        }
        results = follower.sample(prompts, MAX_NEW_TOKENS, 0.0)
        trainer.forward_backward(as_data(prompts, results, advantage=1.0), "ppo_clip")
        trainer.optim_step()
        assert follower.get_weights_version() == 0 and follower.catch_up() == 1
        assert loaded.set_weights(trainer.get_weights()) == 1
        got = [s.sample(prompts, MAX_NEW_TOKENS, 1.0, seed=3) for s in (follower, loaded)]
        assert [x.tokens for x in got[0]] == [x.tokens for x in got[1]]
        pairs = zip(*([lp for x in g for lp in x.logprobs] for g in got), strict=True)
        assert max(abs(a - b) for a, b in pairs) < 0.02  # bf16 rounding of the same weights


def test_a_colocated_policy_plays_in_process_episodes_in_its_own_process(
    ray_cluster, policy, model_dir, tmp_path
):
    """A rollout's in-process episodes (``env.mode: local``) of a colocated policy are played
    in the policy's process, next to its sampler: the same episodes, token for token, as this
    process plays with the same seed; an environment that raises fails its episode only, and
    hung calls of several episodes cost one timeout, side by side."""
    import os
    import time

    import ray
    from sample_envs import WHEREABOUTS

    from flowrl.agent_loop.loop import LoopLimits
    from flowrl.backends.models.chat import ChatSource, chat_format_of
    from flowrl.environments.remote import EnvFactory
    from flowrl.infra.settings import RAY_NAMESPACE as NAMESPACE
    from flowrl.tasks.episodes import plays_in_worker, run_group_episodes

    cache = str(tmp_path / "cache")
    spec = WorkerSpec(model_uri=model_dir, cache_dir=cache)
    ref = start_policy("test-plays", spec, local=False, colocate=True)
    here = policy()  # in this process
    chat = chat_format_of(ChatSource(model_dir, cache))
    envs = EnvFactory(WHEREABOUTS, {}, step_timeout_s=1.0)
    rows = [{"seed": i} for i in range(4)] + [{"fail": "step"}, {"hang": "step"}]
    limits = LoopLimits(max_new_tokens=6)
    try:
        assert plays_in_worker(envs, ref, chat) and not plays_in_worker(envs, here, chat)
        _, pid = ray.get(ray.get_actor(ref.trainer, namespace=NAMESPACE).where.remote())
        began = time.monotonic()
        played = run_group_episodes(envs, rows, 2, ref, chat, limits, seed=3, id_prefix="t")
        assert time.monotonic() - began < 10.0  # the two hung steps: one timeout, not two
        local = run_group_episodes(envs, rows, 2, here, chat, limits, seed=3, id_prefix="t")
    finally:
        stop_policy(ref)
    assert [t.failed for t in played] == [False] * 8 + [True] * 4
    assert {t.info["pid"] for t in played[:8]} == {pid} != {os.getpid()}
    assert {t.info["pid"] for t in local[:8]} == {os.getpid()}
    assert [t.tokens for t in played] == [t.tokens for t in local]
    flat = [[x for t in trajectories for x in t.logprobs] for trajectories in (played, local)]
    assert flat[0] == pytest.approx(flat[1], abs=1e-4)
    assert [(t.reward, t.group_id, t.episode_id) for t in played] == [
        (t.reward, t.group_id, t.episode_id) for t in local
    ]
    assert (
        "failed in step" in played[8].info["error"]
        and "timed out after 1 s" in played[10].info["error"]
    )


def test_an_in_process_policy_restarts_as_a_fresh_one(policy, prompts):
    from flowrl.backends.policy.actors import restart_policy

    warm, fresh = policy(), policy(lora=LORA, seed=5)
    update(warm, as_data(prompts, sampler(warm).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=0), 1.0))
    spec = trainer(fresh).spec
    assert restart_policy(warm, spec) and trainer(warm).spec == spec
    got = [sampler(r).sample(prompts, MAX_NEW_TOKENS, 1.0, seed=2) for r in (warm, fresh)]
    assert [x.logprobs for x in got[0]] == [x.logprobs for x in got[1]]
    weights = [trainer(r).get_weights()[0] for r in (warm, fresh)]
    assert weights[0].keys() == weights[1].keys()  # the adapter's, LoRA as the fresh one


def test_sft_datum_matches_the_agent_loops_token_layout(model_dir):
    """SFT trains on exactly the tokens the sampler would emit for each assistant turn."""
    from flowrl.tasks.sft import sft_datum

    tok = load_tokenizer(model_dir)
    chat = HFChatFormat(tok)
    messages = [
        {"role": "user", "content": "2+3*4=?"},
        {"role": "assistant", "content": '<tool_call>{"expr": "3*4"}</tool_call>'},
        {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "14"},
    ]
    datum = sft_datum(chat, messages)
    whole = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert datum.tokens == list(whole)  # concatenative template: pieces == whole conversation
    trained = tok.decode([t for t, m in zip(datum.tokens, datum.loss_mask, strict=True) if m])
    assert trained == '<tool_call>{"expr": "3*4"}</tool_call><|end|>14<|end|>'
