"""Compile every Triton kernel for CUDA targets (sm_80, sm_90) down to cubins, with no GPU present.

The interpreter accepts code that the compiler rejects (loop-carried types, dot shapes, constexpr
misuse); this catches those on a CPU-only machine. Run without TRITON_INTERPRET:
``python tests/kernels/compile_for_cuda.py`` prints one line per specialization compiled.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter compiles nothing")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import (  # noqa: E402
    triton_attention,
    triton_moe,
    triton_quant_linear,
    triton_rms_norm,
    triton_rotary,
    triton_store_kv,
)

TARGETS = (GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32))


def signature(kernel, pointer_types: dict[str, str], scalar_types: dict[str, str]) -> dict:
    """Pointers (``*_ptr``) from ``pointer_types``, UPPER names constexpr, other args i32."""
    types = {}
    for name in kernel.arg_names:
        if name.isupper():
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = pointer_types[name]
        else:
            types[name] = scalar_types.get(name, "i32")
    return types


def compile_kernel(kernel, pointer_types, constexprs, scalar_types=None) -> None:
    types = signature(kernel, pointer_types, scalar_types or {})
    for target in TARGETS:
        source = ASTSource(fn=kernel, signature=types, constexprs=constexprs)
        compiled = triton.compile(source, target=target)
        assert compiled.asm.get("cubin"), f"no cubin for {kernel.__name__}"
        print(f"compiled {kernel.__name__} sm_{target.arch} {constexprs}", flush=True)


def attention(dtype: str, group: int, head_dim: int, block_m: int, num_splits: int) -> None:
    data = f"*{dtype}"
    target = "*fp32" if num_splits > 1 else data
    pointers = {
        "query_ptr": data, "key_cache_ptr": data, "value_cache_ptr": data, "out_ptr": target,
        "lse_ptr": "*fp32" if num_splits > 1 else data, "query_start_ptr": "*i32",
        "context_lens_ptr": "*i32", "block_tables_ptr": "*i32",
    }  # fmt: skip
    constexprs = {
        "BLOCK_SIZE": 16, "HEAD_DIM": head_dim,
        "HEAD_DIM_PADDED": max(16, triton.next_power_of_2(head_dim)), "GROUP": group,
        "BLOCK_M": block_m, "BLOCK_Q": block_m // group, "TILE": triton_attention.TILE_N,
        "NUM_SPLITS": num_splits, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }  # fmt: skip
    compile_kernel(
        triton_attention._paged_attention_kernel, pointers, constexprs, {"scale_log2": "fp32"}
    )


def main() -> int:
    attention("bf16", group=3, head_dim=64, block_m=16, num_splits=1)
    attention("fp16", group=4, head_dim=128, block_m=64, num_splits=1)
    attention("bf16", group=8, head_dim=128, block_m=16, num_splits=4)
    attention("fp32", group=1, head_dim=80, block_m=16, num_splits=2)
    compile_kernel(
        triton_attention._merge_splits_kernel,
        {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"},
        {"HEAD_DIM": 128, "HEAD_DIM_PADDED": 128, "NUM_SPLITS": 8},
    )
    compile_kernel(
        triton_store_kv._store_kv_kernel,
        {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*bf16",
         "value_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"},
        {"NUM_KV_HEADS": 3, "HEAD_DIM": 64, "HEADS_PADDED": 4, "HEAD_DIM_PADDED": 64},
    )  # fmt: skip
    for has_residual in (False, True):
        compile_kernel(
            triton_rms_norm._rms_norm_kernel,
            dict.fromkeys(
                ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "summed_ptr"), "*bf16"
            ),
            {"HAS_RESIDUAL": has_residual, "BLOCK": 1024},
            {"eps": "fp32"},
        )
    compile_kernel(
        triton_rotary._rotary_kernel,
        {"positions_ptr": "*i64", "query_ptr": "*bf16", "key_ptr": "*bf16", "cos_sin_ptr": "*fp32"},
        {"HALF": 32, "HALF_PADDED": 32, "HEADS_PADDED": 16, "KV_HEADS_PADDED": 4},
    )
    for dtype, bits, num_cols in (
        ("bf16", 4, 1024), ("fp16", 8, 2816), ("fp32", 4, 96), ("fp32", 8, 576),
    ):  # fmt: skip
        pointers = {"q_ptr": "*u8" if bits == 4 else "*i8", "scales_ptr": "*fp16",
                    "mins_ptr": "*fp16", "out_ptr": f"*{dtype}"}  # fmt: skip
        step = triton_quant_linear.tiles(num_cols, bits)
        compile_kernel(
            triton_quant_linear._quant_linear_kernel,
            {**pointers, "x_ptr": f"*{dtype}"},
            {"BITS": bits, "GROUP": 32, "BLOCK_M": step.block_m, "BLOCK_N": step.block_n,
             "BLOCK_K": step.block_k},
        )  # fmt: skip
        compile_kernel(
            triton_quant_linear._dequantize_kernel,
            pointers,
            {"BITS": bits, "GROUP": 32, "BLOCK_N": 32, "BLOCK_K": step.block_k},
        )
    # the fused-MoE product: gate/up (rows shared by top_k pairs), down (weighted), float32
    for dtype, rows_per_a_row, mul_weight, block_m in (
        ("bf16", 2, False, 16), ("bf16", 1, True, 64), ("fp32", 2, True, 16),
    ):  # fmt: skip
        compile_kernel(
            triton_moe._moe_matmul_kernel,
            {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}",
             "weights_ptr": f"*{dtype}", "sorted_pairs_ptr": "*i32",
             "block_experts_ptr": "*i32", "num_padded_ptr": "*i32"},
            {"A_ROWS_PER_ROW": rows_per_a_row, "MUL_WEIGHT": mul_weight,
             "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "BLOCK_M": block_m,
             "BLOCK_N": 64, "BLOCK_K": 64},
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
