"""Evaluation metrics as pure functions."""
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code"): the probability that k samples drawn without replacement
    from the n contain at least one pass, 1 - C(n - c, k) / C(n, k). Using the first k samples
    instead would waste the other n - k; with k = n it is 1 if any passed."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)
