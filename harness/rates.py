"""How often: a per-call rate from k bad calls of n, with its exact (Clopper-Pearson) upper
confidence bound.

The one-sided upper bound at confidence c is the p at which seeing k or fewer bad calls in
n has probability 1 - c: P(X <= k | n, p) = 1 - c. The binomial CDF falls strictly as p
grows, so bisection on it finds that p to any precision (scipy's beta.ppf(c, k + 1, n - k)
is the same number; scipy is not a dependency of the harness). k = 0 gives the closed form
1 - (1 - c)^(1/n): 600 clean calls bound the rate below 0.498 % at 95 %.
"""
from __future__ import annotations

import math


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (n of many thousands is fine)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
             for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def upper_bound(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound on the per-call rate after k bad calls of n."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"k = {k} bad calls of n = {n}: need 0 <= k <= n and n >= 1")
    if k == n:
        return 1.0
    alpha = 1.0 - confidence
    if k == 0:
        return 1.0 - alpha ** (1.0 / n)
    low, high = k / n, 1.0  # the CDF at the point estimate is above alpha for any alpha < 1/2
    for _ in range(200):  # 2^-200: far below a double's resolution
        mid = (low + high) / 2
        if binomial_cdf(k, n, mid) > alpha:
            low = mid
        else:
            high = mid
        if high - low < 1e-15:
            break
    return high


def rate_summary(k: int, n: int, confidence: float = 0.95) -> dict:
    """What a record says: k of n, the observed rate and its upper bound."""
    return {"corrupted": k, "calls": n, "rate": k / n, "upper_bound": upper_bound(k, n, confidence),
            "confidence": confidence, "bound": "one-sided Clopper-Pearson"}
