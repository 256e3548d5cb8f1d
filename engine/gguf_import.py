"""Turns a GGUF file into a Hugging Face model folder (float32 safetensors + tokenizer).

The GGUF reader and dequantizer are transformers' own; this runs once, at preparation time. Serving
never loads weights through transformers (see ``engine/weights.py``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def _say(message: str, progress: bool) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Dequantizes ``gguf_path`` to float32 and writes config, safetensors and tokenizer (with its
    chat template) into ``out_dir``, which must exist and be empty."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if gguf_path.suffix.lower() != ".gguf":
        raise ValueError(f"expected a .gguf file, got {gguf_path.name}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    _say(f"[1/3] reading and dequantizing {gguf_path.name} ...", progress)
    folder, name = gguf_path.parent, gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    _say("[2/3] writing float32 safetensors ...", progress)
    model.save_pretrained(out_dir, safe_serialization=True)
    _say("[3/3] writing the tokenizer and chat template ...", progress)
    tokenizer.save_pretrained(out_dir)
    _say(f"prepared in {time.perf_counter() - start:.1f} s", progress)
