"""The demo's speaking model under vLLM with hotwire: the mood vector (mean difference, computed with transformers)
registered offline turns the greedy stories the other mood, token for token as transformers with a hook does, and
the unsteered batchmates stay as they were."""

from __future__ import annotations

import pytest

import hf_reference
from engine_results import engine_kwargs
from hotwire_core import tiny_speaker as ts

pytestmark = pytest.mark.integration

TOKENS = 20
HAPPY_PROMPT = "the day was bright and"


@pytest.fixture(scope="module")
def speaker(tmp_path_factory):
    return ts.cached_speaker(tmp_path_factory.mktemp("speaker-cache"))


@pytest.fixture(scope="module")
def vector(speaker):
    return ts.mean_difference(speaker, ts.HAPPY_EXAMPLES, ts.SAD_EXAMPLES, ts.STEER_LAYER)


def hf_greedy(model, ids: list[int], scale: float, vector) -> list[int]:
    ids = list(ids)
    steering = [(ts.STEER_LAYER, vector, scale, False)] if scale else []
    for _ in range(TOKENS):
        ids.append(int(hf_reference.logprobs(model, ids, steering)[-1].argmax()))
    return ids[-TOKENS:]


def test_vllm_steers_the_story_to_the_other_mood(speaker, vector):
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from hotwire_core.offline import register_vector, steer

    tokenizer = AutoTokenizer.from_pretrained(str(speaker))
    cases = [  # (prompt, scale, mood of the plain story, mood of the steered one)
        (ts.NEUTRAL_PROMPT, ts.STEER_SCALE, "sad", "happy"),
        (ts.SAD_PROMPT, ts.STEER_SCALE, "sad", "happy"),
        (HAPPY_PROMPT, -ts.STEER_SCALE, "happy", "sad"),
    ]
    llm = LLM(str(speaker), **engine_kwargs())
    try:
        register_vector(llm, "happy", vector)
        requests, params = [], []
        for prompt, scale, _, _ in cases:
            greedy = dict(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
            spec = steer({"id": "happy", "layer": ts.STEER_LAYER, "scale": scale})
            requests += [prompt, prompt]
            params += [SamplingParams(**greedy), SamplingParams(**greedy, extra_args=spec)]
        outputs = llm.generate(requests, params, use_tqdm=False)  # plain and steered in one batch
    finally:
        del llm

    model = hf_reference.load(speaker)
    for i, (prompt, scale, plain_mood, steered_mood) in enumerate(cases):
        ids = tokenizer(prompt).input_ids
        for out, s, mood in ((outputs[2 * i], 0.0, plain_mood), (outputs[2 * i + 1], scale, steered_mood)):
            completion = out.outputs[0]
            label = f"{prompt!r} at scale {s}: {completion.text!r}"
            assert out.prompt_token_ids == ids, label
            assert list(completion.token_ids) == hf_greedy(model, ids, s, vector), f"{label} differs from transformers"
            assert set(completion.text.replace(".", " ").split()) <= ts.CORPUS_WORDS, f"{label}: not corpus words"
            assert ts.judge_mood(completion.text) == mood, f"{label} is not {mood}"
        plain, steered = (outputs[j].outputs[0].text for j in (2 * i, 2 * i + 1))
        print(f"{prompt!r}\n  plain:   {plain!r}\n  steered: {steered!r}")
