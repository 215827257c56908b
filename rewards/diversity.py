"""Diversity of a group's completions, as DIVER computes it (arXiv 2509.26209; authors' code,
NJU-RL/DIVER ``verl/div_src/diversity_metric.py``): symmetric sentence BLEU on whitespace tokens,
and the share of a completion's formulas that no other member of the group wrote."""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Sequence

BLEU_WEIGHTS = (0.02, 0.1, 0.15, 0.25, 0.38)  # authors' code: 1- to 5-gram weights
FORMULA_PATTERNS = (r"\\\[([^\]]*?)\\\]", r"\\\(([^\)]*?)\\\)", r"\$([^\$]*?)\$")  # \[ \], \( \), $ $


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[k : k + n]) for k in range(len(tokens) - n + 1))


def bleu(reference: Sequence[str], hypothesis: Sequence[str], weights: Sequence[float] = BLEU_WEIGHTS) -> float:
    """Sentence BLEU of ``hypothesis`` against one reference, without smoothing: clipped n-gram
    precisions, geometric mean with ``weights``, brevity penalty. An order with a positive weight
    and no match makes it 0 (NLTK's unsmoothed sentence_bleu gives < 1e-100 there)."""
    if not hypothesis:
        return 0.0
    log_p = 0.0
    for n, w in enumerate(weights, start=1):
        if w == 0:
            continue
        hyp, ref = _ngrams(hypothesis, n), _ngrams(reference, n)
        matches = sum(min(c, ref[g]) for g, c in hyp.items())
        if matches == 0:
            return 0.0
        log_p += w * math.log(matches / sum(hyp.values()))
    c, r = len(hypothesis), len(reference)
    brevity = 1.0 if c > r else math.exp(1.0 - r / c)
    return brevity * math.exp(log_p)


def textual_diversity(texts: Sequence[str], weights: Sequence[float] = BLEU_WEIGHTS, max_chars: int = 1000) -> list[float]:
    """TD(o_i) = 1/(G-1) sum_{j != i} (1 - (BLEU(o_i -> o_j) + BLEU(o_j -> o_i)) / 2)."""
    toks = [t[:max_chars].split() for t in texts]
    G = len(toks)
    if G < 2:
        return [0.0] * G
    sim = [[0.0] * G for _ in range(G)]
    for i in range(G):
        for j in range(i + 1, G):
            sim[i][j] = sim[j][i] = 0.5 * (bleu(toks[i], toks[j], weights) + bleu(toks[j], toks[i], weights))
    return [sum(1.0 - sim[i][j] for j in range(G) if j != i) / (G - 1) for i in range(G)]


def formulas(text: str) -> set[str]:
    """Formulas written between \\[ \\], \\( \\) or $ $ (the raw text inside, as the authors' code)."""
    found: set[str] = set()
    for pattern in FORMULA_PATTERNS:
        found.update(re.findall(pattern, text))
    return found


def equational_diversity(texts: Sequence[str], max_chars: int = 1000) -> list[float]:
    """ED(o_i) = |F(o_i) minus the union of F(o_j), j != i| / |F(o_i)|; 0 when o_i has no formula."""
    sets = [formulas(t[:max_chars]) for t in texts]
    out = []
    for i, own in enumerate(sets):
        if not own:
            out.append(0.0)
            continue
        others = set().union(*(s for j, s in enumerate(sets) if j != i))
        out.append(len(own - others) / len(own))
    return out
