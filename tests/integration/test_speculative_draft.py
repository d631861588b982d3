"""Speculative decoding with a draft model (``speculative_config={"model": ..., "num_speculative_tokens": k}``)
under hotwire: the cases of ``tests/speculation_cases.py``, and the draft model runs unsteered."""

from __future__ import annotations

import pytest

from speculation_cases import *  # noqa: F403 (the fixtures and tests every form of speculation must pass)
from speculation_cases import PLAIN, STEERED, K

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def speculative_config(tiny_model) -> dict:
    # The target's own weights as the draft model: unsteered requests accept every draft, so a steered request
    # that accepts fewer shows the drafter was not steered.
    return {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": K}


def test_a_draft_model_is_left_plain(engine):
    """With the target's weights as its draft model, a plain request accepts every draft; a steered one rejects
    drafts, because the drafter proposes unsteered continuations (a steered drafter would match it just as well).
    hotwire hooks the target's decoder layers only: a vector fits the target's hidden size, not the drafter's."""
    (plain_drafted, plain_accepted), (drafted, accepted) = engine["drafts"][PLAIN], engine["drafts"][STEERED]
    assert plain_drafted > 0 and plain_accepted == plain_drafted, engine["drafts"]
    assert drafted > 0 and accepted < drafted, engine["drafts"]
