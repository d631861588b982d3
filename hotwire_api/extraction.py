"""``POST /steer/vectors/extract``: a steering vector from contrastive examples, computed on this server's engine.

The examples run as one-token capture requests through the engine client (ordinary prefill work for vLLM's
scheduler, beside other traffic), at most ``HOTWIRE_CAPTURE_ROWS`` at a time; their activations are taken from the
workers (``hotwire_take_captures``), the vector is computed in numpy (``hotwire_core.extraction``) and registered
through the ordinary register path, so the store and a fleet's registry see an ordinary, versioned registration.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
from hotwire_api.codec import VectorPayload
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.models import Example, ExtractRequest, ExtractResult, LayerSeparation
from hotwire_api.settings import Settings
from hotwire_api.tickets import TICKETS
from hotwire_core.error_codes import ErrorCode
from hotwire_core.capture_admission import capture_args
from hotwire_core.extraction import ExtractionError, check_sets, example_token_ids, extract, layer_list, means_from_captures
from hotwire_core.spec import TICKET_KEY
from hotwire_core.vllm_glue.capture_requests import max_model_len, run_capture_request, tokenizer_of

__all__ = ["run_extraction"]


def _as_plain(example: Example) -> Any:
    return example if isinstance(example, str) else [m.model_dump() for m in example]


def _http(exc: ExtractionError) -> HotwireError:
    return HotwireError(exc.status, exc.code, exc.message, exc.field)


def _token_ids(body: ExtractRequest, tokenizer: Any, limit: int) -> list[list[int]]:
    """Every example's prompt tokens, positives first; 400 for one longer than ``limit``."""
    out = []
    for name, examples in (("positive", body.positive), ("negative", body.negative)):
        for i, example in enumerate(examples):
            ids = example_token_ids(tokenizer, _as_plain(example))
            if not ids:
                raise HotwireError(400, ErrorCode.EMPTY_EXAMPLE, f"{name}[{i}] has no tokens", f"{name}[{i}]")
            if len(ids) > limit:
                raise HotwireError(400, ErrorCode.EXAMPLE_TOO_LONG, f"{name}[{i}] is {len(ids)} tokens long; at most {limit} "
                                   "are allowed (HOTWIRE_EXTRACT_MAX_TOKENS, and the model's max_model_len)",
                                   f"{name}[{i}]")
            out.append(ids)
    return out


async def _capture(engine: HotwireEngine, prompts: list[list[int]], layers: list[int], position: str, rows: int,
                   hidden: int) -> np.ndarray:
    """Activations of every prompt, ``rows`` capture requests at a time."""
    out = []
    for start in range(0, len(prompts), rows):
        chunk = prompts[start : start + rows]
        tags = [uuid.uuid4().hex for _ in chunk]
        tickets = [TICKETS.issue(None) for _ in chunk]  # the engine keeps a refusal under its ticket
        try:
            done = await asyncio.gather(*(
                run_capture_request(engine.client, ids, {**capture_args(tag, layers, position), TICKET_KEY: ticket},
                                    f"hotwire-capture-{tag}")
                for ids, tag, ticket in zip(chunk, tags, tickets)
            ))
            if not all(done):
                refusals = await engine.refusals([t for t, ok in zip(tickets, done) if not ok])
                raise next(iter(refusals.values()), HotwireError(
                    500, "capture_failed", "the engine failed a capture request; its log says why"))
        finally:
            for ticket in tickets:
                TICKETS.close(ticket)
        answers = await engine.take_captures(tags)
        try:
            out.append(means_from_captures(answers, tags, layers, hidden))
        except ExtractionError as exc:
            raise _http(exc) from None
    return np.concatenate(out)


async def run_extraction(engine: HotwireEngine, body: ExtractRequest, settings: Settings, model: Any,
                         register: Any) -> tuple[bool, ExtractResult]:
    """Extract and register (``register(vector_id, payload, replace) -> (created, meta)``: the register path);
    ``model``: the catalog's model (``hotwire_core.admission.ModelInfo``)."""
    if not model.steerable:
        raise HotwireError(503, ErrorCode.MODEL_NOT_STEERABLE, f"this model cannot be steered or captured: {model.reason}")
    if not model.capture_rows:
        raise HotwireError(503, ErrorCode.CAPTURE_OFF, "activation capture is off on this server; start it with "
                           "HOTWIRE_CAPTURE=1 to extract vectors")
    if not body.replace and any(meta.id == body.id for meta in await engine.vectors()):  # before the work
        raise HotwireError(409, ErrorCode.EXISTS, f"vector {body.id!r} is already registered; send replace: true to make "
                           "a new version", "id")
    total = len(body.positive) + len(body.negative)
    if total > settings.extract_max_examples:
        raise HotwireError(400, ErrorCode.TOO_MANY_EXAMPLES, f"{total} examples; at most {settings.extract_max_examples} "
                           "(positive and negative together) are allowed (HOTWIRE_EXTRACT_MAX_EXAMPLES)", "positive")
    try:
        layers = layer_list(body.layers, model.layers)
        check_sets(len(body.positive), len(body.negative), body.method)
    except ExtractionError as exc:
        raise _http(exc) from None
    limit = min(settings.extract_max_tokens, max_model_len(engine.client) - 1)
    prompts = _token_ids(body, tokenizer_of(engine.client), limit)
    acts = await _capture(engine, prompts, layers, body.position, model.capture_rows, model.hidden_size)
    n = len(body.positive)
    vectors, report = await asyncio.to_thread(extract, acts[:n], acts[n:], layers, body.method, body.normalize)
    rows = np.ascontiguousarray(vectors, np.float32)
    payload = VectorPayload(rows.tobytes(), "float32", tuple(rows.shape), tuple(layers))
    created, meta = await register(body.id, payload, body.replace)
    return created, ExtractResult(vector=meta, method=body.method, position=body.position,
                                  examples={"positive": n, "negative": len(body.negative)},
                                  layers=[LayerSeparation(**r) for r in report])
