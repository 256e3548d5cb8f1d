"""A GGUF file's quantized weights, kept as they are: Q4_0 and Q4_1 blocks become 4-bit groups of
32, Q8_0 blocks 8-bit groups of 32 (``engine/quantization.py``), byte for byte, with no float in
between; then they are stored beside the float weights of a prepared model folder.

    Q4_1 block (20 bytes): scale f16 | min f16 | 16 bytes of nibbles   w = scale * q + min
    Q4_0 block (18 bytes): scale f16 | 16 bytes of nibbles             w = scale * (q - 8)
    Q8_0 block (34 bytes): scale f16 | 32 int8                         w = scale * q

The nibbles are in the order our 4-bit layout uses, so they are copied as they are; Q4_0's min is
-8 * scale (exact in float16: a power of two times a float16).

The stored file, ``quantized.safetensors`` in the folder, holds for each weight ``<name>.qweight``,
``<name>.scales`` and, for 4 bits, ``<name>.mins``, under the checkpoint's own (Hugging Face)
names; its metadata entry ``splitfuse.quantized`` maps each name to its bits, group size and GGUF
type. (compressed-tensors' asymmetric int4 stores integer zero points; Q4_1's min is a float16, so
that format would round it.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.quantization import QuantizedTensor
from engine.weights import QUANTIZED_FILE

METADATA_KEY = "splitfuse.quantized"

# GGML type id -> (name, bytes per block of 32, bits)
_BLOCK_TYPES = {2: ("Q4_0", 18, 4), 3: ("Q4_1", 20, 4), 8: ("Q8_0", 34, 8)}

# GGUF tensor name (after "blk.{i}.") -> Hugging Face Llama name (after "model.layers.{i}.")
_LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def decode_blocks(data: np.ndarray, type_id: int, num_rows: int, num_cols: int) -> QuantizedTensor:
    """GGUF block bytes [num_rows, bytes per row] -> a QuantizedTensor [num_rows, num_cols]."""
    name, block_bytes, bits = _BLOCK_TYPES[type_id]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(
        num_rows, num_cols // 32, block_bytes
    )
    scales = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0])
    if name == "Q4_1":
        mins = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0])
        qweight = torch.from_numpy(blocks[:, :, 4:].reshape(num_rows, num_cols // 2).copy())
    elif name == "Q4_0":
        mins = -8 * scales  # exact: a float16 times a power of two (checked below)
        if not torch.isfinite(mins).all():
            raise ValueError("a Q4_0 scale too large for float16 once multiplied by -8")
        qweight = torch.from_numpy(blocks[:, :, 2:].reshape(num_rows, num_cols // 2).copy())
    else:  # Q8_0
        mins = None
        qweight = torch.from_numpy(
            blocks[:, :, 2:].copy().view(np.int8).reshape(num_rows, num_cols)
        )
    return QuantizedTensor(qweight, scales, mins, bits, 32)


def _rope_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary permutation of q/k weights: Hugging Face row j
    is GGUF row ``order[j]``. (GGUF keeps each head's two rotary halves interleaved.)"""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(num_rows)


def read_quantized_gguf(gguf_path: Path) -> dict[str, tuple[QuantizedTensor, str]]:
    """The Llama GGUF file's Q4_0 / Q4_1 / Q8_0 weights under Hugging Face names, with their GGUF
    type; other types (F32 norms, K-quants) and other architectures are left to the float
    weights."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    if architecture != "llama":
        return {}

    def int_field(key: str) -> int:
        entry = reader.fields[key]
        return int(entry.parts[entry.data[0]][0])

    num_heads = int_field("llama.attention.head_count")
    num_kv_heads = (
        int_field("llama.attention.head_count_kv")
        if "llama.attention.head_count_kv" in reader.fields
        else num_heads
    )
    out: dict[str, tuple[QuantizedTensor, str]] = {}
    for tensor in reader.tensors:
        type_id = int(tensor.tensor_type)
        if type_id not in _BLOCK_TYPES:
            continue
        num_cols, num_rows = (int(size) for size in tensor.shape[:2])
        if tensor.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif tensor.name == "output.weight":
            name = "lm_head.weight"
        elif tensor.name.startswith("blk."):
            _, layer, kind, _ = tensor.name.split(".")
            if kind not in _LLAMA_LAYER_NAMES:
                continue
            name = f"model.layers.{layer}.{_LLAMA_LAYER_NAMES[kind]}.weight"
        else:
            continue
        quantized = decode_blocks(tensor.data, type_id, num_rows, num_cols)
        if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
            heads = num_heads if "q_proj" in name else num_kv_heads
            quantized = quantized.take_rows(_rope_rows(num_rows, heads))
        out[name] = (quantized, _BLOCK_TYPES[type_id][0])
    return out


def write_quantized_file(gguf_path: Path, model_dir: Path) -> bool:
    """Stores the GGUF file's quantized weights in ``model_dir`` (``QUANTIZED_FILE``); False where
    it has none that map."""
    weights = read_quantized_gguf(gguf_path)
    if not weights:
        return False
    tensors: dict[str, torch.Tensor] = {}
    description: dict[str, dict[str, object]] = {}
    for name, (quantized, gguf_type) in weights.items():
        tensors[f"{name}.qweight"] = quantized.qweight.contiguous()
        tensors[f"{name}.scales"] = quantized.scales.contiguous()
        if quantized.mins is not None:
            tensors[f"{name}.mins"] = quantized.mins.contiguous()
        description[name] = {
            "bits": quantized.bits,
            "group_size": quantized.group_size,
            "gguf_type": gguf_type,
        }
    save_file(
        tensors, str(Path(model_dir) / QUANTIZED_FILE), {METADATA_KEY: json.dumps(description)}
    )
    return True


def read_quantized_file(model_dir: Path) -> dict[str, QuantizedTensor]:
    """The folder's stored quantized weights by checkpoint name (empty where it has none)."""
    path = Path(model_dir) / QUANTIZED_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = handle.metadata() or {}
        description = json.loads(metadata.get(METADATA_KEY, "{}"))
        out = {}
        for name, entry in description.items():
            bits, group_size = int(entry["bits"]), int(entry["group_size"])
            mins = handle.get_tensor(f"{name}.mins") if bits == 4 else None
            out[name] = QuantizedTensor(
                handle.get_tensor(f"{name}.qweight"),
                handle.get_tensor(f"{name}.scales"),
                mins,
                bits,
                group_size,
            )
    return out
