"""Shared by the parity tests: transformers references and the near-tie rule.

CPU matrix products round differently for different row counts (float32 rows differ by ~1e-6
between batch sizes), so two correct greedy runs can part at a near-tie. Comparisons therefore go
token by token and accept a divergence only where the reference's top-2 logits are within
``NEAR_TIE`` of each other; after an accepted divergence the rest of the sequence is not compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEAR_TIE = 1e-3
LOGITS_ATOL = 1e-4


@dataclass
class Reference:
    """A greedy continuation and the logits each of its tokens was chosen from."""

    token_ids: list[int]
    logits: torch.Tensor  # [len(token_ids), vocab_size] float32


def hf_generate(model, prompt_ids: Sequence[int], max_new_tokens: int) -> Reference:
    """transformers' greedy ``generate`` for one prompt (no padding), with its raw logits."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=model.generation_config.eos_token_id,
        )
    token_ids = out.sequences[0, len(prompt_ids) :].tolist()
    logits = torch.cat([step.float() for step in out.logits], dim=0)  # [num_new, vocab]
    return Reference(token_ids, logits[: len(token_ids)])


def hf_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """transformers' logits at every position of one sequence, float32 ``[len, vocab]``."""
    with torch.inference_mode():
        return model(torch.tensor([list(token_ids)])).logits[0].float()


def reference_from_sequence(
    model, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> Reference:
    """The reference logits for a continuation produced elsewhere: one transformers forward over
    prompt + output; row i holds the logits that chose ``output_ids[i]``."""
    logits = hf_logits(model, list(prompt_ids) + list(output_ids))
    start = len(prompt_ids) - 1
    return Reference(list(output_ids), logits[start : start + len(output_ids)])


def count_greedy_divergence(reference: Reference, actual: Sequence[int], what: str) -> int:
    """0 when ``actual`` equals the reference tokens; 1 when they part at a near-tie (top-2
    reference logits within NEAR_TIE); raises AssertionError for any other difference."""
    expected = reference.token_ids
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if want == got:
            continue
        top2 = reference.logits[index].topk(2).values
        gap = float(top2[0] - top2[1])
        if gap < NEAR_TIE:
            return 1
        raise AssertionError(
            f"{what}: token {index} is {got}, expected {want} (reference top-2 gap {gap:.2e}, "
            f"not a near-tie)\nexpected {expected}\nactual   {list(actual)}"
        )
    assert len(expected) == len(actual), (
        f"{what}: {len(actual)} tokens, expected {len(expected)}\n{expected}\n{list(actual)}"
    )
    return 0
