"""Tiny random Llama / Qwen2 model folders for tests, built without any download.

``make_tiny_model(path)`` writes what a Hugging Face model folder holds: ``config.json`` from a
transformers config, random weights as safetensors (``save_pretrained``), and a real tokenizer: a
byte-level BPE (vocab ~1,000) trained on the small English corpus below, wrapped as a
``PreTrainedTokenizerFast`` with bos/eos tokens and a ChatML chat template. The corpus is ASCII, so
any multi-byte UTF-8 character is split across several tokens, as with real tokenizers.

Weights are drawn so that logits spread (std ~1) instead of the near-uniform logits of the usual
0.02 initialisation: greedy parity tests then meet few near-ties.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

VOCAB_SIZE = 1000
BOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, IM_START_TOKEN, EOS_TOKEN)  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system answers many requests at once.
Once upon a time there was a little town by the sea, where the boats came home every evening and
the children ran down to the harbour to count them. The fishermen told stories of storms and of
calm days, of the lighthouse keeper who never slept and of the whale that followed a boat for a
week. What is the capital of France? The capital of France is Paris. Paris is a large city on the
river Seine, known for its museums, its bridges and its cafes. Berlin is the capital of Germany,
Rome is the capital of Italy, and Madrid is the capital of Spain. London stands on the Thames.
A language model reads a sequence of tokens and predicts the next one. It turns each token into a
vector, mixes the vectors with attention, and projects the result back onto the vocabulary. The
cache keeps the keys and values of the tokens it has already seen, so that each new token costs
only one more row of work. Blocks of the cache are handed out from a pool and returned when a
request finishes. A scheduler decides which requests run in each step and how many of their
tokens, so that long prompts are cut into chunks and mixed with the decoding of other requests.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty,
thirty, forty, fifty, a hundred, a thousand. 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 65536.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

class Cache:
    def __init__(self, size):
        self.size = size
        self.blocks = [None] * size
The weather today is sunny with a light wind from the west. Tomorrow it will rain in the morning
and clear up in the afternoon. In the mountains, snow is expected above two thousand metres.
She opened the door, looked at the garden, and smiled: the roses had finally come out. He said
that he would come back before dinner, but the train was late and the station was crowded.
Questions and answers: Who wrote the letter? Why did they leave early? Where does the road go?
When will the shop open again? How many apples are left in the basket? Which one is yours?
Good morning! Thank you very much. You are welcome. Please sit down. See you later, my friend.
The system prompt says: you are a helpful assistant. The user asks a question, and the assistant
gives a short, clear and correct answer, then stops. Lists are written with dashes or numbers.
- first item
- second item
1. open the file
2. read the data
3. close the file
Water boils at one hundred degrees and freezes at zero. The earth goes around the sun once a year
and the moon goes around the earth about once a month. Light is faster than sound.
"""


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Trains the byte-level BPE once per process and returns its serialized form."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    lines = _CORPUS.splitlines(keepends=True)
    tokenizer.train_from_iterator(lines * 4, trainer=trainer)
    return tokenizer.to_str()


def make_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The test tokenizer: byte-level BPE, bos ``<|endoftext|>``, eos ``<|im_end|>``, ChatML."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=BOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_config(
    arch: str,
    *,
    vocab_size: int,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None,
    intermediate_size: int,
    tie_word_embeddings: bool,
    rope_scaling: dict | None,
    max_position_embeddings: int,
    bos_token_id: int,
    eos_token_id: int,
):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        rope_theta=10000.0,
    )
    if rope_scaling is not None:
        common["rope_scaling"] = dict(rope_scaling)
    if arch == "llama":
        return LlamaConfig(head_dim=head_dim or hidden_size // num_heads, **common)
    if arch == "qwen2":
        if head_dim not in (None, hidden_size // num_heads):
            raise ValueError("Qwen2 has no head_dim setting: head_dim = hidden_size // num_heads")
        return Qwen2Config(**common)
    raise ValueError(f"unknown arch {arch!r}: expected 'llama' or 'qwen2'")


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with std 1/sqrt(fan_in) (logits of std ~1), norms near 1, small biases."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            value = 0.1 * noise
        elif param.dim() == 2:
            value = noise / math.sqrt(param.shape[1])
        else:
            value = 0.02 * noise
        param.copy_(value.to(param.dtype))


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 1024,
) -> Path:
    """Writes a tiny random ``arch`` model folder (config, safetensors, tokenizer) at ``path``.

    Deterministic in ``seed``. ``rope_scaling`` is a transformers rope dict, e.g.
    ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256}``.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    config = _build_config(
        arch,
        vocab_size=len(tokenizer),
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def read_config(path: str | Path) -> dict:
    """The folder's config.json as a dict (handy in tests)."""
    return json.loads((Path(path) / "config.json").read_text())
