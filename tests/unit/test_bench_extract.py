"""benchmarks/bench_extract.py: the pure parts (prompt lengths, a stream's pace over a window, the paired summary)."""

from __future__ import annotations

import random

import pytest
from benchmark_module import load

bench = load("bench_extract")


class _WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


def test_prompts_are_the_shortest_texts_of_at_least_the_length():
    texts = bench.prompts(_WordTokenizer(), 5, 12, random.Random(0))
    assert len(texts) == 5 and len(set(texts)) == 5
    assert all(len(text.split()) == 12 for text in texts)


def test_pace_counts_tokens_between_the_first_and_last_chunk_in_the_window():
    stream = [(0.0, 1), (1.0, 3), (1.5, 5), (2.5, 9), (4.0, 12)]
    assert bench.pace_ms(stream, 0.9, 3.0) == pytest.approx(1000 * 1.5 / 6)  # chunks at 1.0 and 2.5
    assert bench.pace_ms(stream, 3.0, 3.5) is None  # no chunk in the window
    assert bench.pace_ms([(1.0, 3), (2.0, 3)], 0.0, 5.0) is None  # no token between them


def test_summary_pairs_extraction_with_the_ordinary_burst_of_the_same_round():
    rounds = [{"burst": "none", "wall_s": 0.0, "stream_ms_per_token": 6.0},
              {"burst": "extract", "wall_s": 0.5, "stream_ms_per_token": 6.6},
              {"burst": "ordinary", "wall_s": 0.8, "stream_ms_per_token": 6.0},
              {"burst": "ordinary", "wall_s": 0.7, "stream_ms_per_token": 6.4},
              {"burst": "extract", "wall_s": 0.4, "stream_ms_per_token": 6.4}]
    summary = bench.summarize(rounds)
    assert summary["extract_over_ordinary_pace"] == pytest.approx([1.1, 1.0])
    assert summary["median"]["extract"]["wall_s"] == pytest.approx(0.45)
    assert summary["median"]["none"]["stream_ms_per_token"] == 6.0
