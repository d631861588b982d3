"""The knobs of one soak (:class:`SoakConfig`), what its clients draw from (:class:`Plan`: class, route,
stream, spec, prompt) and the JSON body of one request."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .responses import PATHS
from .steering import CLASS_WEIGHTS, PHASE_OF, Entry, Spec

PROMPTS = (
    "The quick brown fox jumps over",
    "Hello, how are you today?",
    "Once upon a time there was a tiny model",
    "Steering vectors nudge the residual stream of a language model.",
    "0123456789 + - * / = ( ) [ ] { }",
    "vLLM serves many requests at once with continuous batching and CUDA graphs. " * 6,
)


@dataclass
class SoakConfig:
    """The knobs of one soak (see ``--help``)."""

    clients: int = 8
    duration: float = 60.0
    ids: int = 40
    churned: int = 8
    pool: int = 3
    max_tokens: int = 8
    replace_every: float = 0.3
    delete_every: float = 0.7
    absent_for: float = 0.05
    churn_share: float = 0.5
    mix: str = "all"
    poll_every: float = 0.05
    request_timeout: float = 120.0
    drain_timeout: float = 30.0
    strength: float | None = None
    seed: int = 0
    api_key: str | None = None
    id_prefix: str = "soak"
    keep_vectors: bool = False
    tenants: int = 0  # > 0: that many tenants, each with every id (soak.tenants)
    flood: bool = False  # with tenants: one more flooding distinct vectors
    flood_windows: float = 0.0  # with flood: it floods in every other window of that many seconds (0: throughout)
    client_processes: int = 0  # processes the clients run in; 0: one per processes.CLIENTS_PER_PROCESS clients


@dataclass
class Plan:
    """What the clients draw from: the served model's name, the steered layer, prompts, ids and the strength."""

    model: str
    layer: int
    strength: float
    static: list[str]
    churned: list[str]
    config: SoakConfig

    def draw(self, rng: random.Random) -> tuple[str, bool, Spec, int]:
        """(route, streamed, spec, prompt index) of one request."""
        kind = self._draw_class(rng)
        route = rng.choice(("completions", "chat") if kind == "stacked" else tuple(PATHS))
        return route, rng.random() < 0.5, self._draw_spec(rng, kind), rng.randrange(len(PROMPTS))

    def _draw_class(self, rng: random.Random) -> str:
        weights = dict(CLASS_WEIGHTS)
        if self.config.mix == "plain":
            return "plain"
        if self.config.mix == "steered":
            weights.pop("plain")
        return rng.choices(list(weights), list(weights.values()))[0]

    def _pick_id(self, rng: random.Random, avoid: str | None = None) -> str:
        while True:
            churned = self.churned and (not self.static or rng.random() < self.config.churn_share)
            vector_id = rng.choice(self.churned if churned else self.static)
            if vector_id != avoid:
                return vector_id

    def _draw_spec(self, rng: random.Random, kind: str) -> Spec:
        if kind == "plain":
            return Spec(kind)
        scale = rng.uniform(1.0, 1.5) * self.strength
        first = self._pick_id(rng)
        as_list = rng.random() < 0.5
        if kind == "stacked":
            second = self._pick_id(rng, avoid=first)
            return Spec(kind, (Entry(first, self.layer, 2 * scale, as_list=as_list), Entry(second, self.layer, scale)))
        return Spec(kind, (Entry(first, self.layer, scale, PHASE_OF[kind], as_list),))


def request_body(plan: Plan, route: str, stream: bool, spec: Spec, prompt: str, top: int = 2) -> dict[str, Any]:
    """The JSON body of one request: temperature 0, ``ignore_eos``, token ids with top-``top`` logprobs."""
    body: dict[str, Any] = {"model": plan.model, "temperature": 0, "ignore_eos": True, "stream": stream}
    n = plan.config.max_tokens
    if route == "completions":
        body |= {"prompt": prompt, "max_tokens": n, "logprobs": top, "return_tokens_as_token_ids": True}
    elif route == "chat":
        body |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "logprobs": True,
                 "top_logprobs": top, "return_tokens_as_token_ids": True}  # fmt: skip
    else:
        body |= {"input": prompt, "max_output_tokens": n}
    wire = spec.wire()
    if wire is not None:
        body["vllm_xargs"] = {"hotwire": wire}
    return body


def soak_ids(config: SoakConfig) -> tuple[list[str], list[str]]:
    """(static ids, churned ids)."""
    churned = min(config.churned, config.ids)
    static = [f"{config.id_prefix}-s{i:02d}" for i in range(config.ids - churned)]
    return static, [f"{config.id_prefix}-c{i:02d}" for i in range(churned)]
