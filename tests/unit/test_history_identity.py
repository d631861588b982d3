"""benchmarks/history_identity.py: prompts, comparing two runs, and reading the four comparisons (no engine)."""

from __future__ import annotations

import math

import pytest
from benchmark_module import load

hi = load("history_identity")


def run(tokens, top, cached=0):
    """A run as the worker saves it; ``top``: per position a {token: logprob} dict."""
    return {"token_ids": list(tokens), "top": [sorted(([t, lp] for t, lp in pos.items()), key=lambda e: -e[1])
                                               for pos in top],
            "num_cached_tokens": cached, "finish_reason": "length"}


def test_prompts_have_exact_lengths_differ_per_length_and_are_reproducible():
    vocab = list(range(4, 512))
    a, b = hi.make_prompt(16, vocab), hi.make_prompt(64, vocab)
    assert len(a) == 16 and len(b) == 64 and set(a + b) <= set(vocab)
    assert a != b[:16]  # no shared first block: one length's prompt cannot hit another's cache
    assert hi.make_prompt(16, vocab) == a
    assert hi.parse_lengths("16, 64") == [16, 64]
    for bad in ("", "16,16", "0", "16,-1"):
        with pytest.raises(ValueError):
            hi.parse_lengths(bad)


def test_compare_runs_takes_the_largest_difference_over_positions_and_top_entries():
    a = run([7, 8], [{7: -0.5, 9: -1.0}, {8: -0.25, 3: -2.0}])
    assert hi.compare_runs(a, a) == {"max_abs": 0.0, "first_diff": None, "tokens_match": True, "entry_sets_differ": 0,
                                     "compared": 4}
    b = run([7, 8], [{7: -0.5, 9: -1.0}, {8: -0.25, 3: -2.0 + 8e-5}])  # a non-sampled top entry moved
    c = hi.compare_runs(a, b)
    assert c["max_abs"] == pytest.approx(8e-5) and c["first_diff"] == 1 and c["tokens_match"]
    assert hi.fmt(c) == "8e-05@1"
    assert not hi.same(c, 0.0) and hi.same(c, 1e-4)


def test_compare_runs_stops_after_the_first_different_token_and_counts_other_top_sets():
    a = run([7, 8, 1], [{7: -0.5, 9: -1.0}, {8: -0.6, 3: -0.7}, {1: -0.1}])
    b = run([7, 3, 2], [{7: -0.5, 5: -1.0}, {3: -0.65, 8: -0.7}, {2: -9.0}])  # position 2 continues another text
    c = hi.compare_runs(a, b)
    assert c["tokens_match"] is False and c["entry_sets_differ"] == 1 and c["first_diff"] == 0
    assert c["max_abs"] == pytest.approx(0.1)  # 8 at position 1; position 2 is not compared
    assert hi.fmt(c) == "0.1!tok!set@0"
    assert not hi.same(c, 1.0)
    inf = run([7], [{7: -math.inf}])
    assert hi.compare_runs(inf, inf)["max_abs"] == 0.0  # equal infinities are equal, not nan
    assert hi.compare_runs(run([7], [{7: -0.5}]), run([7], []))["max_abs"] == math.inf


def comparisons(**differing):
    """The four comparisons, those named (``hv_hist`` etc.) differing by 1e-4."""
    names = {"hv_hist": "hw~van hist", "hv_ctrl": "hw~van ctrl", "van": "van hist~ctrl", "hw": "hw hist~ctrl"}
    return {name: {"max_abs": 1e-4 if differing.get(key) else 0.0, "first_diff": 0 if differing.get(key) else None,
                   "tokens_match": True, "entry_sets_differ": 0} for key, name in names.items()}


@pytest.mark.parametrize(("differing", "expected"), [
    ({}, "identical"),
    ({"hv_hist": 1, "hw": 1}, "hotwire"),  # vanilla given the same history does not move: hotwire's doing
    ({"van": 1, "hw": 1}, "vllm"),  # both move alike with history: vLLM's own
    ({"hv_hist": 1, "van": 1, "hw": 1}, "vllm+hotwire?"),
    ({"hv_ctrl": 1, "hv_hist": 1}, "base"),
    ({"hv_hist": 1}, "mixed"),  # only possible within a tolerance
])
def test_reading(differing, expected):
    assert hi.reading(comparisons(**differing), 0.0) == expected


def test_rows_and_table():
    p = run([7], [{7: -0.5}])
    q = run([7], [{7: -0.5 + 8e-5}])
    steered = run([9], [{9: -0.1}])
    results = {e: {"64": {"P1": q if e == "hotwire-history" else p, "P2": q if e == "hotwire-history" else p}}
               for e in hi.ENGINES}
    for e in ("vanilla-history", "hotwire-history"):
        results[e]["64"]["H"] = steered if e.startswith("hotwire") else p
    rows = hi.build_rows(results, [64], 0.0)
    assert [(r["run"], r["reading"]) for r in rows] == [("P1", "hotwire"), ("P2", "hotwire")]
    history = hi.history_rows(results, [64])
    assert history[0]["steering_fired"] and hi.same(history[0]["vanilla_salted_H_vs_control_P1"], 0.0)
    table = hi.format_table(rows, history).splitlines()
    assert table[0].split()[:3] == ["len", "run", "cached"] and "8e-05@0" in table[2] and "hotwire" in table[2]
    assert table[-1].startswith("H at 64: steering moved it by -!tok!set@0 (fired")  # no common top entry
