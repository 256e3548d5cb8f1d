"""Row-wise logits transforms and sampling used by the sampler: pure functions on tensors.

The filters take ``logits`` of shape ``[num_rows, vocab_size]`` (float32) and per-row parameters
of shape ``[num_rows]``, and return a new tensor, leaving the input unchanged. A token is removed
from the distribution by setting its logit to ``-inf``.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties.

    Repetition (as transformers' RepetitionPenaltyLogitsProcessor) covers the prompt and output
    tokens: a seen token's logit is divided by the penalty when positive, multiplied when negative.
    Frequency and presence (OpenAI) cover output tokens only:
    ``logit -= frequency * count + presence * (count > 0)``.

    output_counts [num_rows, vocab_size] float32: times each token was sampled so far.
    prompt_mask   [num_rows, vocab_size] bool: the token occurs in the prompt.
    """
    output_mask = output_counts > 0  # [num_rows, vocab_size]
    repetition = repetition_penalty.unsqueeze(1)  # [num_rows, 1]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(output_mask | prompt_mask, penalised, logits)
    logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    return logits - presence_penalty.unsqueeze(1) * output_mask


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` most likely tokens, then the smallest most-likely set whose
    probability (renormalised after top-k) reaches ``top_p``.

    The rows are ranked once: with ``topk(max_k)`` when every row has a top-k (a partial sort,
    tens of times cheaper than sorting a 49152-token row on a CPU), else with a full sort.
    Ties at the k-th logit are broken by that order, so exactly k tokens remain.

    top_k [num_rows] int64 in [1, max_k], or None when no row has one (max_k is then ignored).
    top_p [num_rows] float32 in (0, 1] (1: off), or None when no row has one.
    """
    if top_k is not None:
        ranked_logits, ranked_ids = logits.topk(max_k, dim=-1)  # [num_rows, max_k], best first
        ranks = torch.arange(max_k, device=logits.device)  # [max_k]
        ranked_logits = ranked_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    else:
        ranked_logits, ranked_ids = logits.sort(dim=-1, descending=True)  # [num_rows, vocab_size]
    if top_p is not None:
        probs = ranked_logits.softmax(dim=-1)
        # Probability of the tokens ranked above each token: [0.5, 0.3, 0.2] -> [0, 0.5, 0.8].
        # With top_p = 0.7 the first two stay (0 and 0.5 are below 0.7), the third goes.
        mass_above = probs.cumsum(dim=-1) - probs
        # A row with top_p = 1 keeps everything, even where rounding lifts mass_above to 1.
        drop = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        ranked_logits = ranked_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, ranked_ids, ranked_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token.

    min_p [num_rows] float32 in [0, 1].
    """
    probs = logits.softmax(dim=-1)  # [num_rows, vocab_size]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [num_rows, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row r gives token i with probability probs[r, i] / sum(probs[r]).

    A uniform number per row picks the token whose cumulative-probability interval holds it.
    The cumulative sums are float64, so every token keeps its float32 probability (to ~1e-16)
    and a token of probability 0 (an empty interval) is never returned. One random number per
    row: a CPU draws a 49152-wide noise vector (an exponential race) ~100x slower than this.

    probs [num_rows, vocab_size] float32; uniform [num_rows] float64 in [0, 1).
    Returns [num_rows] int64.
    """
    cdf = probs.double().cumsum(dim=-1)  # [num_rows, vocab_size]
    total = cdf[:, -1:]  # [num_rows, 1]
    # uniform * total can round up to total itself; the target must stay below it.
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniform.unsqueeze(1) * total, below_total)  # [num_rows, 1]
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Only a row without any finite logit (probs all NaN) could land past the end.
    return token_ids.clamp_max_(probs.shape[-1] - 1)
