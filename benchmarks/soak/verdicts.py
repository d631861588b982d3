"""The verdict on each response: its transport, then emptiness, then its content (the markers it shows) against
its receipt; and the counts, by kind, detail and route, over a whole run."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .markers import MarkerBook
from .responses import TOKEN_ROUTES, Observation
from .steering import Entry, ReceiptEntry, parse_receipt, receipt_problem

FAILURE_KINDS = (
    "wrong_vector", "wrong_phase", "receipt_mismatch", "silent_empty", "truncated", "dropped", "http_error",
    "stream_error", "timeout", "rejected_429", "churn_error", "poll_error", "not_drained",
)  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    """``kind``: "ok", "refused_expected" or one of FAILURE_KINDS; ``reason``: a short fixed phrase to count by;
    ``detail``: what exactly was seen."""

    kind: str
    reason: str = ""
    detail: str = ""


OK = Verdict("ok")


def classify(obs: Observation, book: MarkerBook, max_tokens: int) -> Verdict:
    """The verdict on one response: its transport, then emptiness, then content against the receipt."""
    verdict = _transport_verdict(obs, book) or _size_verdict(obs, max_tokens)
    if verdict is None:
        verdict = _steered_verdict(obs, book, max_tokens) if obs.spec.steered else _plain_verdict(obs, book, max_tokens)
    return verdict or OK


def _transport_verdict(obs: Observation, book: MarkerBook) -> Verdict | None:
    if obs.failure is not None:
        return Verdict(*obs.failure)
    if obs.status != 200:
        if obs.status == 429:
            return Verdict("rejected_429", str(obs.error_code), obs.error_text[:200])
        ids = [e.vector_id for e in obs.spec.entries]
        if obs.status == 400 and obs.error_code == "unknown_vector" and book.was_absent(ids, obs.start, obs.end):
            return Verdict("refused_expected", "unknown_vector while its id was deleted")
        return Verdict("http_error", f"{obs.status}:{obs.error_code}", obs.error_text[:300])
    if obs.content.error is not None:  # an error event, or an error in a 200's body
        code, message = obs.content.error
        if obs.stream:
            return Verdict("stream_error", code, message[:300])
        return Verdict("http_error", f"200:{code}", message[:300])
    if obs.stream and not obs.content.complete:
        if obs.content.has_output:
            return Verdict("dropped", "stream ended without its final event")
        return Verdict("silent_empty", "stream ended with no output and no error event")
    return None


def _size_verdict(obs: Observation, max_tokens: int) -> Verdict | None:
    content = obs.content
    if not content.has_output:
        return Verdict("silent_empty", "200 with no generated token")
    count = len(content.tokens) if obs.route in TOKEN_ROUTES else content.output_tokens
    if count is not None and count < max_tokens:
        return Verdict("truncated", "fewer tokens than max_tokens", f"{count} of {max_tokens} tokens")
    return None


def _plain_verdict(obs: Observation, book: MarkerBook, max_tokens: int) -> Verdict | None:
    if obs.receipt is not None:
        return Verdict("receipt_mismatch", "receipt on a plain request", obs.receipt)
    threshold = max(2, max_tokens // 2)
    if obs.route in TOKEN_ROUTES:
        counts = Counter(t for t in obs.content.tokens if t in book.owner)
        shown = [t for t, n in counts.items() if n >= threshold]
    else:
        shown = [t for t in book.owner if book.text[t] * threshold in obs.content.text]
    if shown:
        return Verdict("wrong_vector", "plain request shows a marker", book.describe(shown[0]))
    return None


def _steered_verdict(obs: Observation, book: MarkerBook, max_tokens: int) -> Verdict | None:
    receipt, problem = _read_receipt(obs, book)
    if problem is None:
        expected = [book.marker(r.vector_id, r.version) for r in receipt]
    else:
        expected = [None] * len(obs.spec.entries)
    verdict = _content_verdict(obs, book, max_tokens, expected)
    if verdict is None and problem is not None:
        return Verdict("receipt_mismatch", *problem)
    return verdict


def _read_receipt(obs: Observation, book: MarkerBook) -> tuple[tuple[ReceiptEntry, ...], tuple[str, str] | None]:
    """The receipt's entries, and (reason, detail) when it cannot vouch for the content: missing, unreadable,
    not matching the request, or naming a version the soak never registered."""
    if obs.receipt is None:
        return (), ("no receipt on a steered answer", "")
    try:
        receipt = parse_receipt(obs.receipt)
    except ValueError as exc:
        return (), ("unreadable receipt", str(exc))
    problem = receipt_problem(obs.spec.entries, receipt)
    if problem is not None:
        return receipt, ("receipt differs from the request", problem)
    unknown = [f"{r.vector_id}@{r.version}" for r in receipt if book.marker(r.vector_id, r.version) is None]
    if unknown:
        return receipt, ("receipt names a version never registered", ", ".join(unknown))
    return receipt, None


def _content_verdict(obs: Observation, book: MarkerBook, n: int, expected: list[int | None]) -> Verdict | None:
    """Whether what steered each entry's region is the marker its receipt version carries."""
    entries = obs.spec.entries
    content = obs.content
    if obs.spec.kind == "stacked":
        first, second = entries
        return (_judge_region(content.tokens[:n], expected[0], first.vector_id, book, "top-1")
                or _judge_region(content.second[:n], expected[1], second.vector_id, book, "runner-up"))  # fmt: skip
    (entry,) = entries
    if obs.route in TOKEN_ROUTES:
        region = {"all": content.tokens[:n], "decode": content.tokens[1:n], "prefill": content.tokens[:1]}[entry.phase]
    else:
        region = text_region(content.text, entry.phase, n, book)
    return _judge_region(region, expected[0], entry.vector_id, book, entry.phase) or _off_phase(obs, entry, book, n)


def text_region(text: str, phase: str, n: int, book: MarkerBook) -> list[int | None]:
    """The markers a text shows where ``phase`` steers, as if read token by token: ``[m] * k`` when that region
    is k copies of marker m's text (all: the whole text, n copies; decode: its end, n - 1; prefill: its start,
    one), else ``[None]``. Marker texts are prefix- and suffix-free, so at most one marker fits."""
    for token, mark in book.text.items():
        if phase == "all" and text == mark * n:
            return [token] * n
        if phase == "decode" and n > 1 and text.endswith(mark * (n - 1)) and text != mark * n:
            return [token] * (n - 1)
        if phase == "prefill" and text.startswith(mark):
            return [token]
    return [None]


def _judge_region(
    region: Sequence[int | None], expected: int | None, vector_id: str, book: MarkerBook, where: str
) -> Verdict | None:
    """None when every token of the region is ``expected``; with ``expected`` None (no usable receipt), when
    they are all one marker of ``vector_id``."""
    if expected is not None and region and all(t == expected for t in region):
        return None
    foreign = [t for t in region if t is not None and book.owner.get(t) not in (None, vector_id)]
    if foreign:
        return Verdict("wrong_vector", f"{where}: another id's marker",
                       f"{vector_id} requested, content shows {book.describe(foreign[0])}")  # fmt: skip
    unsteered = sum(1 for t in region if t is None or t not in book.owner)
    if unsteered or not region:
        return Verdict("wrong_vector", f"{where}: unsteered content",
                       f"{unsteered} of {len(region)} steered positions unsteered ({vector_id})")  # fmt: skip
    shown = sorted(set(region), key=str)
    if expected is None and len(shown) == 1:
        return None
    return Verdict(
        "receipt_mismatch",
        f"{where}: content of another version",
        f"content shows {', '.join(book.describe(t) for t in shown)}; "
        f"the receipt's version carries {book.describe(expected)}",
    )


def _off_phase(obs: Observation, entry: Entry, book: MarkerBook, n: int) -> Verdict | None:
    """A decode_only entry that steered token 0 too, or a prefill_only one that steered the generated tokens."""
    if entry.phase == "all":
        return None
    mine = set(book.pools[entry.vector_id])
    if obs.route in TOKEN_ROUTES:
        tokens = obs.content.tokens
        off = tokens[:1] if entry.phase == "decode" else tokens[1:n]
        steered_off = bool(off) and all(t in mine for t in off)
    else:
        steered_off = any(obs.content.text == book.text[t] * n for t in mine)
    if steered_off:
        return Verdict("wrong_phase", f"{entry.phase}_only steered the other phase too", entry.vector_id)
    return None


def example(obs: Observation, verdict: Verdict, book: MarkerBook) -> dict[str, Any]:
    """What to show of one judged request."""
    content = obs.content
    error = content.error or ((obs.error_code, obs.error_text[:300]) if obs.error_code else None)
    return {
        "reason": verdict.reason,
        "detail": verdict.detail,
        "route": obs.route,
        "stream": obs.stream,
        "class": obs.spec.kind,
        "spec": obs.spec.wire(),
        "prompt": obs.prompt,
        "t_start": round(obs.start, 3),
        "t_end": round(obs.end, 3),
        "status": obs.status,
        "receipt": obs.receipt,
        "tokens": content.tokens,
        "tokens_as": [book.text.get(t, "·") for t in content.tokens],
        "runner_up": content.second if obs.spec.kind == "stacked" else None,
        "text": content.text,
        "output_tokens": content.output_tokens,
        "finish": content.finish,
        "events": content.events,
        "error": error,
    }


def route_key(obs: Observation) -> str:
    return f"{obs.route}{'/stream' if obs.stream else ''}"


def judge_all(observations: Sequence[Observation], book: MarkerBook, max_tokens: int, examples_per_kind: int = 5
              ) -> dict[str, Any]:  # fmt: skip
    """Counts by verdict kind, by detail and by route, and a few examples per failure kind."""
    kinds: Counter[str] = Counter()
    details: dict[str, Counter[str]] = defaultdict(Counter)
    routes: dict[str, Counter[str]] = defaultdict(Counter)
    examples: dict[str, list[dict[str, Any]]] = defaultdict(list)
    verdicts = []
    for obs in observations:
        verdict = classify(obs, book, max_tokens)
        verdicts.append(verdict)
        kinds[verdict.kind] += 1
        if verdict.kind == "ok":
            continue
        details[verdict.kind][verdict.reason] += 1
        routes[verdict.kind][route_key(obs)] += 1
        if len(examples[verdict.kind]) < examples_per_kind:
            examples[verdict.kind].append(example(obs, verdict, book))
    return {"kinds": kinds, "details": details, "routes": routes, "examples": examples, "verdicts": verdicts}
