"""Row-wise logits transforms and sampling used by the sampler: pure functions on tensors.

The filters take ``logits`` of shape ``[num_rows, vocab_size]`` (float32) and per-row parameters
of shape ``[num_rows]``, and return a new tensor, leaving the input unchanged. A token is removed
from the distribution by setting its logit to ``-inf``.
"""

from __future__ import annotations

import torch

# Tokens per chunk in sample_from_probs: 49152 tokens -> 192 chunk sums, then 256 tokens.
CDF_CHUNK = 256
# Most likely tokens a CPU tries first for a top-p without a top-k (see _top_p_alone).
TOP_P_CANDIDATES = 1024


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties.

    Repetition (as transformers' RepetitionPenaltyLogitsProcessor) covers the prompt and output
    tokens: a seen token's logit is divided by the penalty when positive, multiplied when negative.
    Frequency and presence (OpenAI) cover output tokens only:
    ``logit -= frequency * count + presence * (count > 0)``.

    output_counts [num_rows, vocab_size] float32: times each token was sampled so far.
    prompt_mask   [num_rows, vocab_size] bool: the token occurs in the prompt (needed only with a
                  repetition penalty).
    Each penalty is [num_rows] float32, or None when no row has it: its passes over the rows are
    then skipped (each is a full [num_rows, vocab_size] pass).
    """
    output_mask = output_counts > 0  # [num_rows, vocab_size]
    if repetition_penalty is not None:
        assert prompt_mask is not None, "the repetition penalty reads the prompt"
        repetition = repetition_penalty.unsqueeze(1)  # [num_rows, 1]
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(output_mask | prompt_mask, penalised, logits)
    else:
        logits = logits.clone()
    if frequency_penalty is not None:
        logits.addcmul_(output_counts, frequency_penalty.unsqueeze(1), value=-1.0)
    if presence_penalty is not None:
        logits.sub_(torch.where(output_mask, presence_penalty.unsqueeze(1), 0.0))
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` most likely tokens, then the smallest most-likely set whose
    probability (renormalised after top-k) reaches ``top_p``.

    The rows are ranked once: with ``topk(max_k)`` when every row has a top-k (a partial sort,
    tens of times cheaper than sorting a 49152-token row on a CPU), else by _top_p_alone.
    Ties at the k-th logit are broken by that order, so exactly k tokens remain.

    top_k [num_rows] int64 in [1, max_k], or None when no row has one (max_k is then ignored).
    top_p [num_rows] float32 in (0, 1] (1: off), or None when no row has one.
    """
    if top_k is None:
        return logits.clone() if top_p is None else _top_p_alone(logits, top_p)
    ranked_logits, ranked_ids = logits.topk(max_k, dim=-1)  # [num_rows, max_k], best first
    ranks = torch.arange(max_k, device=logits.device)  # [max_k]
    ranked_logits = ranked_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        ranked_logits = _nucleus(
            ranked_logits, ranked_logits.logsumexp(dim=-1, keepdim=True), top_p
        )
    return _unrank(logits, ranked_ids, ranked_logits)


def _top_p_alone(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p without a top-k. On a CPU, where reading a mask back costs nothing and sorting
    49152 tokens costs about ten topk(1024), a row whose TOP_P_CANDIDATES most likely tokens hold
    ``top_p`` of its probability is ranked from those alone (every other token is dropped anyway);
    the other rows, and all rows on GPUs (fast sort; a read-back would be a sync), are sorted."""
    log_total = logits.logsumexp(dim=-1, keepdim=True)  # [num_rows, 1]
    if logits.device.type != "cpu" or logits.shape[-1] <= TOP_P_CANDIDATES:
        ranked_logits, ranked_ids = logits.sort(dim=-1, descending=True)
        return _unrank(logits, ranked_ids, _nucleus(ranked_logits, log_total, top_p))
    ranked_logits, ranked_ids = logits.topk(TOP_P_CANDIDATES, dim=-1)
    enough = (ranked_logits - log_total).exp().sum(dim=-1) >= top_p  # [num_rows] bool
    if bool(enough.all()):
        return _unrank(logits, ranked_ids, _nucleus(ranked_logits, log_total, top_p))
    result = torch.empty_like(logits)
    result[enough] = _unrank(
        logits[enough],
        ranked_ids[enough],
        _nucleus(ranked_logits[enough], log_total[enough], top_p[enough]),
    )
    short = ~enough
    rows = logits[short]
    ranked_logits, ranked_ids = rows.sort(dim=-1, descending=True)
    result[short] = _unrank(
        rows, ranked_ids, _nucleus(ranked_logits, log_total[short], top_p[short])
    )
    return result


def _nucleus(
    ranked_logits: torch.Tensor, log_total: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf the ranked logits (best first, [num_rows, n]) outside the smallest prefix whose
    probability, ``exp(logit - log_total)``, reaches ``top_p``. log_total [num_rows, 1]."""
    probs = (ranked_logits - log_total).exp()
    # Probability of the tokens ranked above each token: [0.5, 0.3, 0.2] -> [0, 0.5, 0.8].
    # With top_p = 0.7 the first two stay (0 and 0.5 are below 0.7), the third goes.
    mass_above = probs.cumsum(dim=-1) - probs
    # A row with top_p = 1 keeps everything, even where rounding lifts mass_above to 1.
    drop = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    return ranked_logits.masked_fill(drop, float("-inf"))


def _unrank(
    logits: torch.Tensor, ranked_ids: torch.Tensor, ranked_logits: torch.Tensor
) -> torch.Tensor:
    """Back to vocabulary order; tokens left out of the ranking get -inf."""
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

    One uniform number per row (a CPU draws a 49152-wide noise vector for an exponential race
    ~100x slower). Two levels, so no [num_rows, vocab_size] float64 tensor is built (on a CPU
    its fresh pages cost more than the arithmetic): the number picks a chunk of CDF_CHUNK tokens
    by the float64 CDF of the chunk sums, then, rescaled to that chunk's interval, a token by
    the float64 CDF inside the chunk. Every token keeps its float32 probability to float
    precision, and a token of probability 0 (an empty interval) is never returned.

    probs [num_rows, vocab_size] float32, non-negative; uniform [num_rows] float64 in [0, 1).
    Returns [num_rows] int64.
    """
    num_rows, vocab_size = probs.shape
    num_chunks = -(-vocab_size // CDF_CHUNK)
    if num_chunks * CDF_CHUNK != vocab_size:
        probs = torch.nn.functional.pad(probs, (0, num_chunks * CDF_CHUNK - vocab_size))
    chunks = probs.view(num_rows, num_chunks, CDF_CHUNK)
    chunk_cdf = chunks.sum(dim=-1).double().cumsum(dim=-1)  # [num_rows, num_chunks]
    chunk_ids, within = _invert_cdf(chunk_cdf, uniform)  # [num_rows] each
    picked = chunks.gather(1, chunk_ids.view(-1, 1, 1).expand(-1, 1, CDF_CHUNK)).squeeze(1)
    offsets, _ = _invert_cdf(picked.double().cumsum(dim=-1), within)  # [num_rows]
    return (chunk_ids * CDF_CHUNK + offsets).clamp_max_(vocab_size - 1)


def _invert_cdf(cdf: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row, the interval of ``cdf`` (inclusive prefix sums, float64 [num_rows, n]) that
    holds ``uniform * total``, and where in it the point lies, as a fraction in [0, 1).

    Example: cdf [0.25, 0.25, 1.0] and uniform 0.5: the point 0.5 lies in [0.25, 1.0), the
    interval of index 2 (index 1 has an empty interval and is never picked), at 1/3 of it.
    Returns (index [num_rows] int64, fraction [num_rows] float64).
    """
    total = cdf[:, -1:]  # [num_rows, 1]
    # uniform * total can round up to total itself; the point must stay below it.
    below_total = torch.nextafter(total, torch.zeros_like(total))
    point = torch.minimum(uniform.unsqueeze(1) * total, below_total)  # [num_rows, 1]
    # Only a row without any finite probability (NaN) could land past the end.
    index = torch.searchsorted(cdf, point, right=True).clamp_max_(cdf.shape[1] - 1)
    upper = cdf.gather(1, index)
    lower = torch.where(index > 0, cdf.gather(1, (index - 1).clamp_min_(0)), 0.0)
    fraction = ((point - lower) / (upper - lower)).clamp_(0.0, 1.0 - 2**-53)
    return index.squeeze(1), fraction.squeeze(1)
