"""The demo's speaking model: trained deterministically in seconds, it continues prompts with corpus sentences, and
the mean-difference mood vector (transformers + a forward hook, ``hf_reference``) turns its stories the other
mood, as judged by counting mood words."""

import time

import pytest
import torch

import hf_reference
from hotwire_core import tiny_speaker as ts

# CPU seconds (training runs on one thread): wall time on a shared machine measures the neighbours. Measured 10-12 s
# of CPU; of wall time 10-11 s on an idle 2-core machine, 21-41 s with a load of 7-13.
BUILD_BUDGET_CPU_S = 30.0
TOKENS = 20
HAPPY_PROMPTS = ("the day was bright and", "my brother laughed and", "it was a sunny morning .")
SAD_PROMPTS = (ts.SAD_PROMPT, "the day was grey and", "my sister cried and", "it was a dark night .")
NEUTRAL_PROMPTS = (ts.NEUTRAL_PROMPT, "the day was", "my friend", "it was a")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    path = ts.build_speaker(tmp_path_factory.mktemp("speaker") / "a")
    return path, time.process_time() - start_cpu, time.perf_counter() - start_wall


@pytest.fixture(scope="module")
def model(built):
    return hf_reference.load(built[0])


@pytest.fixture(scope="module")
def tokenizer(built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(built[0]))


@pytest.fixture(scope="module")
def vector(built):
    return ts.mean_difference(built[0], ts.HAPPY_EXAMPLES, ts.SAD_EXAMPLES, ts.STEER_LAYER)


def greedy(model, tokenizer, prompt: str, scale: float = 0.0, vector=None) -> str:
    """``TOKENS`` greedy tokens after ``prompt``, with ``scale * vector`` added after :data:`STEER_LAYER`."""
    ids = tokenizer(prompt).input_ids
    steering = [(ts.STEER_LAYER, vector, scale, False)] if vector is not None else []
    for _ in range(TOKENS):
        ids.append(int(hf_reference.logprobs(model, ids, steering)[-1].argmax()))
    return tokenizer.decode(ids[len(tokenizer(prompt).input_ids):])


def words(text: str) -> list[str]:
    return text.replace(".", " ").split()


def test_training_is_fast_deterministic_and_cached(built, tmp_path, monkeypatch):
    path, first_cpu_s, first_wall_s = built
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    again = ts.cached_speaker(tmp_path)
    second_cpu_s, second_wall_s = time.process_time() - start_cpu, time.perf_counter() - start_wall
    print(f"builds took {first_cpu_s:.1f} and {second_cpu_s:.1f} CPU s, {first_wall_s:.1f} and {second_wall_s:.1f} s")
    assert max(first_cpu_s, second_cpu_s) < BUILD_BUDGET_CPU_S, "training took too long"
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (path / name).read_bytes() == (again / name).read_bytes(), f"{name} differs between two builds"

    assert again.name == f"speaker-{ts.recipe_hash()}"
    assert not list(tmp_path.glob("*.tmp-*")), "the build's scratch folder was left behind"
    monkeypatch.setattr(ts, "build_speaker", lambda path: pytest.fail("a cached folder was trained again"))
    assert ts.cached_speaker(tmp_path) == again


def test_judge_mood_counts_mood_words():
    assert ts.mood_counts("The day was bright. I felt sad and lonely.") == {"happy": 1, "sad": 2}
    assert ts.judge_mood("i felt glad . the sky was warm and grey .") == "happy"
    assert ts.judge_mood("it was a cold night .") == "sad"
    assert ts.judge_mood("the sky was warm and grey .") is None
    assert ts.judge_mood("the room was the room") is None


@pytest.mark.parametrize("prompt", NEUTRAL_PROMPTS + SAD_PROMPTS + HAPPY_PROMPTS)
def test_continuations_are_corpus_sentences(model, tokenizer, prompt):
    text = greedy(model, tokenizer, prompt)
    assert len(words(text)) >= TOKENS // 2, text
    assert set(words(text)) <= ts.CORPUS_WORDS, f"{text!r} has words outside the corpus"
    expected = "happy" if prompt in HAPPY_PROMPTS else "sad"  # the neutral prompts happen to start sad stories
    assert ts.judge_mood(text) == expected, text


def test_vector_is_a_mood_direction(vector):
    assert vector.shape == (ts.SHAPE.hidden_size,) and vector.dtype == torch.float32
    assert 0.1 < float(vector.norm()) < 100.0


@pytest.mark.parametrize("prompt", NEUTRAL_PROMPTS + SAD_PROMPTS)
def test_steering_toward_happy_turns_the_story_happy(model, tokenizer, vector, prompt):
    plain = greedy(model, tokenizer, prompt)
    steered = greedy(model, tokenizer, prompt, ts.STEER_SCALE, vector)
    assert ts.judge_mood(plain) == "sad", plain
    assert ts.judge_mood(steered) == "happy", f"{prompt!r}: plain {plain!r}, steered {steered!r}"
    assert ts.mood_counts(steered)["sad"] == 0, steered
    assert set(words(steered)) <= ts.CORPUS_WORDS, f"{steered!r} has words outside the corpus"


@pytest.mark.parametrize("prompt", HAPPY_PROMPTS)
def test_steering_against_the_vector_turns_the_story_sad(model, tokenizer, vector, prompt):
    steered = greedy(model, tokenizer, prompt, -ts.STEER_SCALE, vector)
    assert ts.judge_mood(steered) == "sad", f"{prompt!r}: steered {steered!r}"


def test_a_small_scale_is_not_enough(model, tokenizer, vector):
    """The flip comes from the vector's size, not from any perturbation: a tenth of the scale leaves it sad."""
    steered = greedy(model, tokenizer, ts.SAD_PROMPT, ts.STEER_SCALE / 10, vector)
    assert ts.judge_mood(steered) == "sad", steered
