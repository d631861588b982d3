"""Calibration before the run: read the served model's folder (layers, dtype, LM head, token texts), pick the
markers away from the prompts' plain answers, find the steering strength, and check that every route and phase
shows the markers as the verdicts expect."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from .clients import http_client
from .markers import MarkerBook, choose_markers, printable_marker_text, unit, vector_body
from .plan import PROMPTS, Plan, request_body
from .responses import PATHS, TOKEN_ROUTES, Content, read_whole
from .steering import Entry, Spec

STRENGTH_GRID = tuple(4.0**k for k in range(-2, 10))  # candidate steering norms, up to ~2.6e5
STRENGTH_FACTOR = 128.0  # the soak steers this much harder than the weakest grid strength that already wins
MAX_ADDED = {"float16": 4096.0}  # hotwire's too_strong limit on the norm a request adds (1e6 otherwise)


class CalibrationError(RuntimeError):
    """The model or server cannot give the soak markers that steer as it needs: no verdict could be trusted."""


@dataclass(frozen=True)
class ModelFacts:
    """What the soak reads from the served model's folder."""

    n_layers: int
    dtype: str
    unembedding: np.ndarray  # [vocab, hidden] float32: the LM head rows


def read_model(model_dir: Path) -> ModelFacts:
    """Layer count, dtype and the LM head (or the tied embeddings) of an HF folder with safetensors weights."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    n_layers = int(text.get("num_hidden_layers") or config["num_hidden_layers"])
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or text.get("dtype") or "bfloat16")
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    embeddings = ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                  "language_model.model.embed_tokens.weight"]  # fmt: skip
    names = ([] if tied else ["lm_head.weight"]) + embeddings
    return ModelFacts(n_layers, dtype, _read_tensor(model_dir, names))


def _read_tensor(model_dir: Path, names: Sequence[str]) -> np.ndarray:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    files = sorted(model_dir.glob("*.safetensors"))
    for name in names:
        for path in [model_dir / weight_map[name]] if name in weight_map else files:
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():
                    return f.get_tensor(name).float().numpy()
    raise CalibrationError(f"none of {list(names)} in {model_dir}'s safetensors files")


def single_token_texts(model_dir: Path, vocab_rows: int) -> dict[int, str]:
    """Each ordinary token's text, for tokens whose repetition decodes to the repeated text (byte-level BPE:
    all; SentencePiece word-start tokens: not); special and added tokens left out."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    skip = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    texts = {}
    for t in range(min(len(tok), vocab_rows)):
        if t in skip:
            continue
        text = tok.decode([t])
        if printable_marker_text(text) and tok.decode([t, t, t]) == text * 3:
            texts[t] = text
    return texts


@dataclass
class Calibration:
    strength: float
    first_winning: float | None
    excluded: int
    markers: dict[str, list[str]]


async def served_model(http: httpx.AsyncClient) -> str:
    response = await http.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def steerable_layers(text: str) -> set[int]:
    """``"0-3"`` or ``"8,10,12-15"`` (``/steer/slots`` ``model.layers``) as a set."""
    layers: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        layers.update(range(int(low), int(high or low) + 1))
    return layers


async def plain_tokens(http: httpx.AsyncClient, plan: Plan) -> set[int]:
    """Every token (and runner-up) the prompts' plain answers hold on completions and chat, which markers avoid;
    raises when a plain answer comes back short or unreadable."""
    seen: set[int] = set()
    for route in TOKEN_ROUTES:
        for prompt in PROMPTS:
            response = await http.post(PATHS[route], json=request_body(plan, route, False, Spec("plain"), prompt))
            if response.status_code != 200:
                raise CalibrationError(f"plain {route} answered {response.status_code}: {response.text[:300]}")
            content = read_whole(route, response.json())
            if len(content.tokens) != plan.config.max_tokens:
                raise CalibrationError(f"plain {route} gave {len(content.tokens)} tokens for {prompt!r}")
            seen.update(content.tokens)
            seen.update(t for t in content.second if t is not None)
    return seen


async def steered_content(http: httpx.AsyncClient, plan: Plan, route: str, spec: Spec) -> list[Content]:
    """The content of one steered, non-streamed request per prompt (no receipt check: calibration only)."""
    out = []
    for prompt in PROMPTS:
        response = await http.post(PATHS[route], json=request_body(plan, route, False, spec, prompt))
        if response.status_code != 200:
            raise CalibrationError(f"steered {route} answered {response.status_code}: {response.text[:300]}")
        out.append(read_whole(route, response.json()))
    return out


async def find_strength(http: httpx.AsyncClient, plan: Plan, probe: str, marker: int, limit: float
                        ) -> tuple[float, float]:  # fmt: skip
    """(the weakest grid strength at which the probe's marker takes every position of every prompt, the strength
    the soak uses: STRENGTH_FACTOR times that, within ``limit``)."""
    n = plan.config.max_tokens
    for strength in (s for s in STRENGTH_GRID if s <= limit):
        spec = Spec("single", (Entry(probe, plan.layer, strength),))
        contents = await steered_content(http, plan, "completions", spec)
        if all(c.tokens == [marker] * n for c in contents):
            return strength, min(strength * STRENGTH_FACTOR, limit)
    raise CalibrationError(f"no steering strength up to {limit:g} makes the marker win at layer {plan.layer}")


async def check_markers(http: httpx.AsyncClient, plan: Plan, probes: tuple[str, str], markers: tuple[int, int],
                        texts: dict[int, str]) -> None:  # fmt: skip
    """At the soak's strength (the lower end of its scale range): every route shows the marker, stacked entries
    rank as their scales, decode_only and prefill_only steer only their phase."""
    n, s, layer = plan.config.max_tokens, plan.strength, plan.layer
    a, b = markers
    checks = {
        "single": (Spec("single", (Entry(probes[0], layer, s),)), lambda c: c.tokens == [a] * n),
        "stacked": (Spec("stacked", (Entry(probes[0], layer, 2 * s), Entry(probes[1], layer, s))),
                    lambda c: c.tokens == [a] * n and c.second == [b] * n),
        "decode_only": (Spec("decode_only", (Entry(probes[0], layer, s, "decode"),)),
                        lambda c: c.tokens[1:] == [a] * (n - 1) and c.tokens[0] != a),
        "prefill_only": (Spec("prefill_only", (Entry(probes[0], layer, s, "prefill"),)),
                         lambda c: c.tokens[0] == a and c.tokens[1:] != [a] * (n - 1)),
    }  # fmt: skip
    for route in TOKEN_ROUTES:
        for name, (spec, good) in checks.items():
            for content in await steered_content(http, plan, route, spec):
                if not good(content):
                    raise CalibrationError(f"{name} on {route} at strength {s:g}: tokens {content.tokens}, "
                                           f"runner-up {content.second}, markers {a}, {b}")  # fmt: skip
    for content in await steered_content(http, plan, "responses", checks["single"][0]):
        if content.text != texts[a] * n:
            raise CalibrationError(f"single on responses at strength {s:g}: text {content.text!r}, marker {texts[a]!r}")


async def calibrate(url: str, plan: Plan, facts: ModelFacts, texts: dict[int, str], book_pools: dict[str, int]
                    ) -> tuple[MarkerBook, Calibration]:  # fmt: skip
    """Pick the markers (avoiding the prompts' plain tokens), find the strength (into ``plan.strength``, unless
    ``--strength`` gave it), check every phase, and build the book; ``book_pools`` is the pool size of each id."""
    config = plan.config
    async with http_client(url, config) as http:
        excluded = await plain_tokens(http, plan)
        norms = np.linalg.norm(facts.unembedding, axis=1)
        try:
            markers = choose_markers(texts, norms, excluded, sum(book_pools.values()), config.seed)
        except ValueError as exc:
            raise CalibrationError(str(exc)) from None
        pools, start = {}, 0
        for vector_id, size in book_pools.items():
            pools[vector_id], start = markers[start:start + size], start + size
        book = MarkerBook({t: texts[t] for t in markers}, pools)
        probes = (f"{config.id_prefix}-probe-a", f"{config.id_prefix}-probe-b")
        for probe, token in zip(probes, markers[:2]):
            body = vector_body(probe, unit(facts.unembedding[token]))
            response = await http.post("/steer/vectors?replace=true", json=body)
            if response.status_code not in (200, 201):
                raise CalibrationError(f"registering {probe} answered {response.status_code}: {response.text[:300]}")
        try:
            first = None
            if config.strength is None:
                limit = MAX_ADDED.get(facts.dtype, 1e6) / 5  # a stacked request adds 2 * 1.5 s + 1.5 s
                first, plan.strength = await find_strength(http, plan, probes[0], markers[0], limit)
            await check_markers(http, plan, probes, (markers[0], markers[1]), texts)
        finally:
            for probe in probes:
                await http.delete(f"/steer/vectors/{probe}")
    shown = {vector_id: [texts[t] for t in pool] for vector_id, pool in pools.items()}
    return book, Calibration(plan.strength, first, len(excluded), shown)
