"""The judging of ``python -m hotwire_core.verify``: what each check compares and when it passes (pure: no engine)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

DECODE_BATCH = 8
MIN_LOGPROB_DELTA = 1e-4  # below this a logprob change is numerical noise, not steering
MAX_DECODE_OVERHEAD = 0.5  # steered decode may cost at most this much more than idle decode (on a GPU)
# On the CPU the op runs as plain torch ops beside a tiny model's few-ms step, and other engines on a 2-core machine
# move the timing by more than the op costs, so only a gross regression (an eager fallback costs several times the
# step) should fail there (the measured overheads are in benchmarks/RESULTS.md).
MAX_DECODE_OVERHEAD_CPU = 2.0
# Readout check (f): steered minus plain score, relative to what the steering added. bf16 rounds the stream it reads
# (an element's error is about 2^-9 of it, and they cancel over the hidden size), so this is far above the noise.
MAX_READOUT_ERROR = 0.01
# vLLM's CPU backend is not bit-reproducible, not even between identical batches in one engine (its logprobs jitter
# by an ulp, 5e-7), so on the CPU "identical" means within this; on a GPU it means bit for bit.
CPU_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Result:
    """What one request produced: sampled token ids, their logprobs and how many prompt tokens came from cache."""

    token_ids: list[int]
    logprobs: list[float]
    num_cached_tokens: int


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str

def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest elementwise difference; infinite when the lengths differ."""
    if len(a) != len(b):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def compare(ours: Sequence[Result], theirs: Sequence[Result], tolerance: float) -> tuple[bool, str]:
    """Whether two lists of results match (same tokens; logprobs bit-identical, or within ``tolerance`` where the
    backend is not bit-reproducible) and how closely, in words."""
    tokens = len(ours) == len(theirs) and all(a.token_ids == b.token_ids for a, b in zip(ours, theirs))
    worst = max((max_abs_diff(a.logprobs, b.logprobs) for a, b in zip(ours, theirs)), default=0.0)
    if tokens and all(a.logprobs == b.logprobs for a, b in zip(ours, theirs)):
        return True, "bit-identical"
    words = f"max |delta| {worst:.3g}" + (f" (CPU tolerance {tolerance:g})" if tolerance > 0 else "")
    return tokens and worst <= tolerance, words if tokens else f"different tokens, {words}"


def differs(plain: Result, steered: Result) -> bool:
    return plain.token_ids != steered.token_ids or max_abs_diff(plain.logprobs, steered.logprobs) > MIN_LOGPROB_DELTA


def check_steering_fires(plain: Result, steered: Result) -> Check:
    changed = sum(a != b for a, b in zip(plain.token_ids, steered.token_ids))
    detail = (
        f"max |logprob delta| {max_abs_diff(plain.logprobs, steered.logprobs):.4g}, "
        f"{changed}/{len(plain.token_ids)} tokens differ"
    )
    return Check("a. steering fires", differs(plain, steered), detail)


def check_batchmates(
    all_plain: Sequence[Result], mixed: Sequence[Result], steered: Sequence[int], tolerance: float
) -> Check:
    """Plain requests of ``mixed`` must match ``all_plain`` (see :func:`compare`); those at ``steered`` must
    differ."""
    plain_idx = [i for i in range(len(mixed)) if i not in steered]
    same, words = compare([mixed[i] for i in plain_idx], [all_plain[i] for i in plain_idx], tolerance)
    fired = all(differs(all_plain[i], mixed[i]) for i in steered)
    detail = (
        f"{len(plain_idx)} plain beside {len(steered)} steered in a batch of {len(mixed)}: "
        f"{words} to an all-plain batch" + ("" if fired else "; a steered mate was not steered")
    )
    return Check("b. batchmates", same and fired, detail)


def check_no_cross_read(name: str, after: Result, uncached: Result, tolerance: float) -> Check:
    """``after`` followed a request with other steering on the same prompt: it must read no cached tokens and
    match ``uncached`` (the same request with ``skip_reading_prefix_cache``)."""
    same, words = compare([after], [uncached], tolerance)
    detail = f"{after.num_cached_tokens} cached tokens read; {words} to an uncached run"
    return Check(name, after.num_cached_tokens == 0 and same, detail)


def check_cache_hit(first: Result, repeat: Result, block_size: int, prompt_len: int) -> Check:
    """An identical steered request must read at least one full block from the prefix cache."""
    detail = (
        f"{repeat.num_cached_tokens}/{prompt_len} prompt tokens from cache (block {block_size}); "
        f"max |delta| to the first run {max_abs_diff(first.logprobs, repeat.logprobs):.3g}"
    )
    return Check("c. prefix cache: steered hit", repeat.num_cached_tokens >= block_size, detail)


def per_step_ms(short_s: float, long_s: float, extra_tokens: int) -> float:
    """Milliseconds per decode step from two runs that differ only by ``extra_tokens`` generated tokens."""
    return (long_s - short_s) / extra_tokens * 1000.0


def idle_graphs_in_place(ranks: Sequence[dict]) -> tuple[bool, str]:
    """Whether every rank had its hotwire-free CUDA graphs in place right after an unsteered step
    (``hotwire_graph_sets`` of each rank): the idle figure of check (d) rests on it."""
    holders = sum(rank.get("holders", 0) for rank in ranks)
    if holders == 0 or not all(rank["split"] for rank in ranks):
        return True, "one graph set (no CUDA graphs, or HOTWIRE_IDLE_GRAPHS=0)"
    serving = sum(rank["serving_idle"] for rank in ranks)
    return serving == holders, f"after an unsteered step {serving} of {holders} graph holders had their hotwire-free set in place"


def check_decode_cost(
    idle_ms: Sequence[float], steered_ms: Sequence[float], max_overhead: float, graph_sets: Sequence[dict]
) -> Check:
    idle, steered = statistics.median(idle_ms), statistics.median(steered_ms)
    overhead = steered / idle - 1.0 if idle > 0 else math.inf
    graphs_ok, graphs = idle_graphs_in_place(graph_sets)
    detail = (
        f"batch {DECODE_BATCH}: idle {idle:.3f} ms/step, steered {steered:.3f} ms/step "
        f"({overhead:+.1%}, limit {max_overhead:+.0%}; median of {len(idle_ms)}); {graphs}"
    )
    return Check("d. decode cost", overhead <= max_overhead and graphs_ok, detail)


def first_differences(ours: Sequence[Result], theirs: Sequence[Result], tolerance: float) -> list[tuple[int, int]]:
    """``(request, token)`` for every request that differs by more than ``tolerance``: its index and the first
    generated token where it does (0: the prompt's processing already differs)."""
    found = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        pairs = list(zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs))
        first = next((j for j, (x, y, p, q) in enumerate(pairs) if x != y or abs(p - q) > tolerance), None)
        if first is None and (len(a.token_ids) != len(b.token_ids) or len(a.logprobs) != len(b.logprobs)):
            first = len(pairs)
        if first is not None:
            found.append((i, first))
    return found


def describe(differences: Sequence[tuple[int, int]]) -> str:
    """``"#4 from token 0, #6 from token 2"`` for :func:`first_differences`' pairs."""
    return ", ".join(f"#{request} from token {token}" for request, token in differences)


def check_vanilla(ours: Sequence[Result], references: Sequence[Sequence[Result]], tolerance: float) -> Check:
    """Plain results against one or two plugin-free engines (see :func:`compare`): each request must equal at
    least one engine's. A failure names the requests that match none (numbered in the order they ran) and where
    they first differ; with two references the detail also says whether those two agree with each other."""
    name, first = "e. vanilla vLLM", references[0]
    counts = [len(ref) for ref in references]
    if any(count != len(ours) for count in counts):  # a reference that ran other requests cannot be compared
        return Check(name, False, f"{len(ours)} plain requests, but the plugin-free engines returned {counts}")
    same, words = compare(ours, first, tolerance)
    if same or len(references) == 1:
        detail = f"{len(ours)} plain requests: {words}"
        if not same:
            detail += f" (requests {describe(first_differences(ours, first, tolerance))})"
        return Check(name, same, detail)
    unmatched = [
        i for i in range(len(ours)) if not any(compare([ours[i]], [ref[i]], tolerance)[0] for ref in references)
    ]
    refs_same, refs_words = compare(references[0], references[1], tolerance)
    if refs_same:
        between = "which agree with each other"
    else:
        where = describe(first_differences(references[0], references[1], tolerance))
        between = f"which differ from each other ({refs_words}; requests {where}): vLLM's own engine-to-engine variation"
    if not unmatched:
        return Check(name, True, f"{len(ours)} plain requests: each equals one of two plugin-free engines, {between}")
    # Where each unmatched request first departs from the references: the earlier of the two positions.
    starts = [dict(first_differences(ours, ref, tolerance)) for ref in references]
    listed = describe([(i, min(start[i] for start in starts)) for i in unmatched])
    if any(ours[i].token_ids != ref[i].token_ids for i in unmatched for ref in references):
        how = "different tokens"
    else:
        worst = max(min(max_abs_diff(ours[i].logprobs, ref[i].logprobs) for ref in references) for i in unmatched)
        how = f"max |delta| to the nearer {worst:.3g}"
    detail = f"{len(ours)} plain requests: {listed} match neither of two plugin-free engines ({how}), {between}"
    return Check(name, False, detail)


def check_readout(plain: Sequence[float], steered: Sequence[float], added: float, max_error: float) -> Check:
    """The probe at the steered layer is the steering vector ``v`` itself, so at every prompt token the steered
    request's score must exceed the plain one's by exactly what steering added along it: ``scale * |v|^2``."""
    name = "f. readout"
    if len(plain) != len(steered) or not plain:
        return Check(name, False, f"{len(plain)} plain and {len(steered)} steered prompt-token values")
    worst = max(abs((s - p) - added) for p, s in zip(plain, steered)) / abs(added)
    detail = (f"{len(plain)} prompt tokens: steered minus plain score is scale x |v|^2 = {added:.5g} within "
              f"{worst:.2g} of it (relative; limit {max_error:g})")
    return Check(name, worst <= max_error, detail)


def check_gates(gated: Sequence[Result], receipts: Sequence[dict], steered: Result, plain: Result, positions: int,
                tolerance: float) -> Check:
    """``gated``: the entry gated on a condition that always holds, then on one that never does; they must match the
    ungated ``steered`` and the ``plain`` request, and their receipts name all ``positions`` and none."""
    name = "g. gates"
    always, never = gated
    held = [r["positions_held"] for r in receipts]
    off = (max_abs_diff(always.logprobs, steered.logprobs), max_abs_diff(never.logprobs, plain.logprobs))
    ok = (always.token_ids == steered.token_ids and never.token_ids == plain.token_ids and max(off) <= tolerance
          and held == [positions, 0] and differs(plain, steered))
    detail = (f"gated on a condition that always holds: {off[0]:.3g} from the entry ungated; that never holds: "
              f"{off[1]:.3g} from plain (tolerance {tolerance:g}); receipts held {held[0]} and {held[1]} of "
              f"{positions} positions")
    return Check(name, ok, detail)
