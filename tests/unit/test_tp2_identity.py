"""benchmarks/tp2_identity.py: grouping engines by bit-identical results."""

from __future__ import annotations

from benchmark_module import load

from hotwire_core.verify import Result

tp2 = load("tp2_identity")


def test_engines_group_by_bit_identical_tokens_and_logprobs():
    a, b = Result([1, 2], [-0.5, -1.0], 0), Result([1, 2], [-0.5, -1.0000001], 0)
    cached = Result([1, 2], [-0.5, -1.0], 64)  # the cache count is not part of the outcome
    other_tokens = Result([1, 3], [-0.5, -1.0], 0)
    engines = [[a, a], [b, a], [cached, a], [other_tokens, a], [b, b]]
    assert tp2.groups(engines, 0) == [[0, 2], [1, 4], [3]]
    assert tp2.groups(engines, 1) == [[0, 1, 2, 3], [4]]
