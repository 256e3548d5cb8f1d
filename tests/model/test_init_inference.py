"""``init_inference`` on transformers models (float32) against the same models' own forward and
``generate``: tiny random Llama and Qwen2, the default model, and tensor parallelism on gloo.

1. ``engine(input_ids, attention_mask).logits``: every unpadded position within 1e-4 of
   transformers' forward over the row alone (for the default model, 1e-4 of the largest logit),
   rows left- and right-padded and longer than the step budget (chunked); padded positions are 0.
2. ``engine.generate``: a batch of 8 prompts of different lengths, left-padded, greedy, equal to
   transformers' one-prompt ``generate`` under the near-tie rule, shaped as transformers returns.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import init_inference
from engine.model_config import ModelConfigError
from tests.model.parity_helpers import LOGITS_ATOL, count_greedy_divergence, hf_generate, hf_logits

pytestmark = pytest.mark.usefixtures("single_thread")

PAD = 0
# a small step budget, so that the longer rows run in several chunks
ENGINE = {"num_kv_blocks": 96, "block_size": 4, "max_batch_tokens": 16, "device": "cpu"}


def _padded(prompts: list[list[int]], left: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, longest]`` ids and attention mask, each row padded on its side."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for index, (prompt, on_left) in enumerate(zip(prompts, left, strict=True)):
        start = width - len(prompt) if on_left else 0
        ids[index, start : start + len(prompt)] = torch.tensor(prompt)
        mask[index, start : start + len(prompt)] = 1
    return ids, mask


def _until_eos(token_ids: list[int], eos_token_id: int) -> list[int]:
    """The tokens up to the first EOS, included (transformers' single-prompt output)."""
    if eos_token_id not in token_ids:
        return token_ids
    return token_ids[: token_ids.index(eos_token_id) + 1]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_llama_dir, tiny_qwen2_dir):
    """(transformers model, its inference engine)."""
    path = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, init_inference(model, dtype=torch.float32, engine=ENGINE)


def test_logits_match_transformers(tiny) -> None:
    model, engine = tiny
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (40, 7, 23)]
    ids, mask = _padded(prompts, left=[True, True, False])
    logits = engine(ids, attention_mask=mask).logits
    assert logits.shape == (3, 40, vocab) and logits.dtype == torch.float32
    for index, prompt in enumerate(prompts):
        got = logits[index][mask[index].bool()]
        diff = (got - hf_logits(model, prompt)).abs().max().item()
        assert diff < LOGITS_ATOL, f"row {index}: max |logit difference| {diff:.2e}"
        assert not logits[index][~mask[index].bool()].any()
    unpadded = engine(torch.tensor([prompts[1]])).logits[0]
    assert (unpadded - logits[1, -7:]).abs().max().item() < LOGITS_ATOL


def test_greedy_generate_matches_transformers(tiny) -> None:
    model, engine = tiny
    rng = random.Random(1)
    vocab = model.config.vocab_size
    eos = model.generation_config.eos_token_id
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 31, 12, 40, 3, 18, 9, 26)]
    ids, mask = _padded(prompts, left=[True] * len(prompts))
    sequences = engine.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=PAD)
    width = sequences.shape[1] - ids.shape[1]
    assert 1 <= width <= 16 and torch.equal(sequences[:, : ids.shape[1]], ids)
    near_ties = 0
    for index, prompt in enumerate(prompts):
        new = sequences[index, ids.shape[1] :].tolist()
        ours = _until_eos(new, eos)
        assert all(token == PAD for token in new[len(ours) :])
        reference = hf_generate(model, prompt, 16)
        near_ties += count_greedy_divergence(reference, ours, f"prompt {index}")
    print(f"near-ties met: {near_ties}")


def test_model_times_per_forward_pass(tiny) -> None:
    model, engine = tiny
    with pytest.raises(RuntimeError, match="profile_model_time"):
        engine.model_times()
    engine.profile_model_time()
    engine(torch.randint(3, model.config.vocab_size, (1, 40)))  # budget 16: three passes
    times = engine.model_times()
    assert len(times) == 3 and all(ms > 0 for ms in times)
    assert engine.model_times() == []
    engine.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, eos_token_id=[])
    assert len(engine.model_times()) == 4  # one engine step per token


def test_bad_input_is_refused(tiny) -> None:
    model, engine = tiny
    vocab = model.config.vocab_size
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="beam search is not supported"):
        engine.generate(ids, num_beams=4)
    with pytest.raises(ValueError, match="nothing to generate"):
        engine.generate(ids, max_length=4)
    assert engine.generate(ids, max_length=6, eos_token_id=[]).shape == (1, 6)
    with pytest.raises(ValueError, match="holes"):
        engine(ids, attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(ValueError, match="no tokens"):
        engine(ids, attention_mask=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="outside"):
        engine(torch.tensor([[5, vocab]]))
    with pytest.raises(ValueError, match=r"shaped \[batch, seq\]"):
        engine(torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="engine runs at most"):
        engine(torch.full((1, 96 * 4 + 1), 5))
    with pytest.raises(ValueError, match="has no experts"):
        init_inference(model, moe=True, engine=ENGINE)
    # the engine still runs after every refusal
    assert engine(ids).logits.shape == (1, 4, vocab)


def test_weights_quantized_in_deepspeed_form(tiny_llama_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    quant = {"enabled": True, "weight": {"num_bits": 8, "group_size": 32}}
    engine = init_inference(model, quant=quant, engine=ENGINE)
    assert engine.llm_engine.runner.quantization_counts["quantized"] == 2 * 4 + 2
    prompt = list(range(3, 24))
    want = hf_logits(model, prompt)
    scale = want.abs().max().item()
    diff = (engine(torch.tensor([prompt])).logits[0] - want).abs().max().item()
    assert diff < 0.05 * scale, f"int8: {diff:.2e} (scale {scale:.1f})"


def test_unsupported_architecture_is_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        init_inference(model)


def test_default_model(default_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    engine = init_inference(
        model, dtype=torch.float32, engine={"num_kv_blocks": 64, "max_batch_tokens": 64}
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    logits = engine(torch.tensor([prompt])).logits[0]
    want = hf_logits(model, prompt)
    # 30 float32 layers, logits up to ~37: 1e-4 of the largest logit (transformers' own logits of
    # a prefix differ by 6e-5 between the prefix alone and the whole prompt)
    scale = want.abs().max().item()
    diff = (logits - want).abs().max().item()
    assert diff < LOGITS_ATOL * max(1.0, scale), f"{diff:.2e} (scale {scale:.1f})"
    sequence = engine.generate(torch.tensor([prompt]), max_new_tokens=12)[0, len(prompt) :]
    count_greedy_divergence(hf_generate(model, prompt, 12), sequence.tolist(), "default model")
    assert "Paris" in tokenizer.decode(sequence), tokenizer.decode(sequence)


def test_tensor_parallel_on_gloo(tiny_llama_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    engine = init_inference(
        model, tensor_parallel={"tp_size": 2}, engine={**ENGINE, "num_threads": 1}
    )
    try:
        # the workers read the weights from shared memory, not from copies sent to each
        assert all(tensor.is_shared() for tensor in model.state_dict().values())
        rng = random.Random(2)
        prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (21, 9)]
        ids, mask = _padded(prompts, left=[True, True])
        logits = engine(ids, attention_mask=mask).logits
        for index, prompt in enumerate(prompts):
            got = logits[index][mask[index].bool()]
            diff = (got - hf_logits(model, prompt)).abs().max().item()
            assert diff < LOGITS_ATOL, f"row {index}: max |logit difference| {diff:.2e}"
        sequences = engine.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=PAD)
        eos = model.generation_config.eos_token_id
        for index, prompt in enumerate(prompts):
            ours = _until_eos(sequences[index, ids.shape[1] :].tolist(), eos)
            count_greedy_divergence(hf_generate(model, prompt, 12), ours, f"prompt {index}")
    finally:
        engine.shutdown()
    assert all(not process.is_alive() for process in engine.llm_engine.executor.group.processes)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_mixture_of_experts_models(arch, tmp_path) -> None:
    """The MoE families through the same door: transformers 5 keeps their experts stacked
    (``experts.gate_up_proj``), which load as the folder's per-expert names do; DeepSpeed's
    ``moe`` block is checked against the model's experts."""
    from tests.tiny_moe_model import make_tiny_moe_model

    path = make_tiny_moe_model(tmp_path / arch, arch, seed=5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    experts = model.config.num_local_experts if arch == "mixtral" else model.config.num_experts
    with pytest.raises(ValueError, match="moe_experts"):
        init_inference(model, moe={"enabled": True, "moe_experts": [experts + 1]}, engine=ENGINE)
    engine = init_inference(
        model, dtype=torch.float32, moe={"enabled": True, "moe_experts": [experts]}, engine=ENGINE
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (19, 6)]
    ids, mask = _padded(prompts, left=[True, False])
    logits = engine(ids, attention_mask=mask).logits
    for index, prompt in enumerate(prompts):
        diff = (logits[index][mask[index].bool()] - hf_logits(model, prompt)).abs().max().item()
        assert diff < LOGITS_ATOL, f"row {index}: max |logit difference| {diff:.2e}"
    sequence = engine.generate(torch.tensor([prompts[0]]), max_new_tokens=8)[0, 19:]
    eos = model.generation_config.eos_token_id
    ours = _until_eos(sequence.tolist(), eos)
    count_greedy_divergence(hf_generate(model, prompts[0], 8), ours, arch)
