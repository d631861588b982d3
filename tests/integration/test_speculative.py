"""Speculative decoding with n-gram drafts (``speculative_config={"method": "ngram", ...}``) under hotwire: the
cases of ``tests/speculation_cases.py``. n-gram drafting runs no model, so nothing on the draft side could be
steered; verification tokens are steered as decode tokens."""

from __future__ import annotations

import pytest

from speculation_cases import *  # noqa: F403 (the fixtures and tests every form of speculation must pass)
from speculation_cases import K

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def speculative_config() -> dict:
    return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
