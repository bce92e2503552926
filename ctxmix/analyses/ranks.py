"""Rank statistics on the model's device, batched: average ranks (ties as scipy) and Spearman rho.

Corpus analyses compare thousands of n x n maps; ranking them one at a time in scipy on the
CPU cost more than computing them on a GPU. Here every map of a batch is ranked in one sort.
Ranks and their sums are float64 (at n = 128 the sums of squared ranks are ~1.5e12, past
float32's exact range).
"""

from __future__ import annotations

import torch


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..m along the last dimension of x (..., m), ties given their average rank (as
    scipy.stats.rankdata's default), in float64. +inf sorts last, so cells to leave out of a
    statistic can be set to +inf and masked afterwards without moving the ranks of the others."""
    v, order = x.sort(dim=-1, stable=True)
    m = x.shape[-1]
    pos = torch.arange(m, device=x.device).expand_as(v)
    starts = torch.ones_like(v, dtype=torch.bool)
    starts[..., 1:] = v[..., 1:] != v[..., :-1]
    ends = torch.ones_like(v, dtype=torch.bool)
    ends[..., :-1] = starts[..., 1:]
    first = torch.where(starts, pos, torch.zeros_like(pos)).cummax(-1).values  # start of each tie group
    last = torch.where(ends, pos, torch.full_like(pos, m - 1)).flip(-1).cummin(-1).values.flip(-1)
    r = (first + last).double() / 2 + 1
    return torch.empty_like(r).scatter_(-1, order, r)


def masked_ranks(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Average ranks of x (..., m) among its valid cells (`valid` broadcastable to x); invalid
    cells get ranks past the valid ones, to be masked by `spearman_from_ranks`."""
    if valid is not None:
        x = torch.where(valid, x, torch.tensor(float("inf"), dtype=x.dtype, device=x.device))
    return average_ranks(x)


def spearman_from_ranks(ra: torch.Tensor, rb: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Pearson r of two rankings (..., m) over their valid cells, float64 (...); NaN where
    either ranking is constant (scipy's Spearman rho returns NaN there too)."""
    w = torch.ones_like(ra) if valid is None else valid.expand_as(ra).double()
    cnt = w.sum(-1, keepdim=True)
    ra = (ra - (cnt + 1) / 2) * w  # the mean of average ranks 1..m is (m + 1) / 2 exactly
    rb = (rb - (cnt + 1) / 2) * w
    cov = (ra * rb).sum(-1)
    var = (ra * ra).sum(-1) * (rb * rb).sum(-1)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=ra.device)
    return torch.where(var > 0, cov / var.clamp(min=1e-300).sqrt(), nan).clamp(-1.0, 1.0)


def spearman(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Spearman rho between a and b (..., m) along the last dimension, over the cells where
    `valid` (broadcastable to (..., m)) is True; float64 (...). NaN where either side is constant
    over its valid cells (scipy returns NaN there too)."""
    return spearman_from_ranks(masked_ranks(a, valid), masked_ranks(b, valid), valid)
