"""A tiny model that speaks, for the demo: Qwen3-shaped (vLLM serves it like :mod:`hotwire_core.tiny_model`'s),
trained in seconds on the CPU, offline and deterministically, on a built-in corpus of short stories in one of two
moods, so steering shows as text a person can read: a sad story turns happy.

    path = cached_speaker(cache_dir)      # trained once, then read from the cache
    vector = mean_difference(path, HAPPY_EXAMPLES, SAD_EXAMPLES, STEER_LAYER)
    # steer SAD_PROMPT with {"layer": STEER_LAYER, "scale": STEER_SCALE}; judge_mood(text) says which mood won

Each story keeps one mood across its sentences, so the model tracks the mood in its residual stream; the mean
difference of that stream between happy and sad examples is the steering vector.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

from . import tiny_model
from .tiny_model import CHAT_TEMPLATE, ModelShape, model_config

HAPPY_THINGS = ("bright", "warm", "sunny", "golden", "lovely", "gentle")
HAPPY_FEELINGS = ("glad", "happy", "cheerful", "calm", "proud", "hopeful")
HAPPY_ACTS = ("laughed", "smiled", "sang", "danced")
SAD_THINGS = ("grey", "cold", "dark", "rainy", "bleak", "dull")
SAD_FEELINGS = ("sad", "unhappy", "lonely", "tired", "afraid", "gloomy")
SAD_ACTS = ("cried", "sighed", "frowned", "wept")
HAPPY_WORDS = frozenset(HAPPY_THINGS + HAPPY_FEELINGS + HAPPY_ACTS)
SAD_WORDS = frozenset(SAD_THINGS + SAD_FEELINGS + SAD_ACTS)
_PLACES = ("day", "morning", "evening", "sky", "garden", "town", "house", "street", "sea", "room")
_PEOPLE = ("my friend", "my sister", "my brother", "the teacher", "our neighbour", "the old man")
_TIMES = ("day", "morning", "evening", "night", "week")
# One sentence each; {thing}, {feeling}, {act} take the story's mood.
_TEMPLATES = (
    "the {place} was {thing} and i felt {feeling} .",
    "{person} {act} and looked {feeling} .",
    "it was a {thing} {time} .",
    "the {place} seemed {thing} .",
    "we went out and {person} was {feeling} .",
    "i felt {feeling} all {time} .",
)
_MOODS = {
    "happy": {"thing": HAPPY_THINGS, "feeling": HAPPY_FEELINGS, "act": HAPPY_ACTS},
    "sad": {"thing": SAD_THINGS, "feeling": SAD_FEELINGS, "act": SAD_ACTS},
}
_SPECIALS = ("<|endoftext|>", "<|unk|>", "<|user|>", "<|assistant|>", "<|system|>")
VOCAB = _SPECIALS + tuple(sorted(
    {w for t in _TEMPLATES for w in t.split() if not w.startswith("{")}
    | {w for words in (_PLACES, _PEOPLE, _TIMES) for phrase in words for w in phrase.split()}
    | HAPPY_WORDS | SAD_WORDS
))
CORPUS_WORDS = frozenset(VOCAB[len(_SPECIALS):])

SHAPE = ModelShape("qwen3", hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32,
                   intermediate_size=128, vocab_size=len(VOCAB))
SEED = 0
STORIES = 1024
SEQ_LEN = 48  # tokens per training story: room for a prompt and the demo's continuation
STEPS = 300
BATCH = 32
LR = 3e-3

# The demo's contrast (matched pairs, one mood word apart), its prompts and its steering. Unsteered, both prompts
# continue sad. Steering with the mean difference after layer 1 turns every test prompt's greedy continuation the
# other way from scale 2 (1.5 misses one); from 4 the text starts to loop ("all morning all morning"). After layer
# 2 (the middle of 4, what the demo steers by default) it takes scale 4; after layer 0 no scale does.
HAPPY_EXAMPLES = (
    "the day was bright and i felt glad .",
    "my friend laughed and looked happy .",
    "it was a warm evening .",
    "the garden seemed lovely .",
)
SAD_EXAMPLES = (
    "the day was grey and i felt sad .",
    "my friend cried and looked unhappy .",
    "it was a cold evening .",
    "the garden seemed bleak .",
)
NEUTRAL_PROMPT = "the morning was"
SAD_PROMPT = "the evening was cold and i felt lonely ."
STEER_LAYER = 1
STEER_SCALE = 3.0


def mood_counts(text: str) -> dict[str, int]:
    """How many of ``text``'s words are happy and how many sad (the corpus's mood words)."""
    words = text.lower().replace(".", " ").split()
    return {"happy": sum(w in HAPPY_WORDS for w in words), "sad": sum(w in SAD_WORDS for w in words)}


def judge_mood(text: str) -> str | None:
    """``"happy"`` or ``"sad"``: the mood most of ``text``'s mood words have; ``None`` on a tie (or none)."""
    counts = mood_counts(text)
    if counts["happy"] == counts["sad"]:
        return None
    return max(counts, key=counts.get)


def stories(n: int = STORIES, seed: int = SEED) -> list[str]:
    """``n`` stories, half of each mood: sentences from the templates until each has :data:`SEQ_LEN` words."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        mood = _MOODS["happy" if i % 2 == 0 else "sad"]
        words: list[str] = []
        while len(words) < SEQ_LEN:
            fill = {k: rng.choice(v) for k, v in mood.items()}
            sentence = rng.choice(_TEMPLATES).format(
                place=rng.choice(_PLACES), person=rng.choice(_PEOPLE), time=rng.choice(_TIMES), **fill
            )
            words += sentence.split()
        out.append(" ".join(words[:SEQ_LEN]))
    return out


def _tokenizer():
    """A word-level tokenizer over :data:`VOCAB` (lowercased; words decode with spaces, "glad ." as "glad.")."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<|unk|>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(cleanup=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|unk|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _train(tokenizer):
    """The trained model: one CPU thread and deterministic kernels, so the weights are the same bytes each time."""
    import torch
    import transformers

    config, model_cls = model_config(SHAPE, "float32")
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(SEED)
        model = getattr(transformers, model_cls)(config)
        data = torch.tensor([tokenizer(s).input_ids for s in stories()])
        order = torch.Generator().manual_seed(SEED)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / STEPS)
        model.train()
        for _ in range(STEPS):
            batch = data[torch.randint(len(data), (BATCH,), generator=order)]
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        return model.eval()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def recipe_hash() -> str:
    """A key for the trained folder: the source of this module (corpus, shape, training) and of the config it
    reuses (:func:`tiny_model.model_config`) decide the weights."""
    digest = hashlib.sha256()
    for module in (__file__, tiny_model.__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()[:16]


def build_speaker(path: str | Path) -> Path:
    """Train the model and write its folder (config.json, tokenizer, float32 safetensors) at ``path``; the folder
    appears whole or not at all (written beside it, then renamed)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = _tokenizer()
    model = _train(tokenizer)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    try:
        tmp.rename(path)
    except OSError:  # built meanwhile by another process: theirs is the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
        if not path.is_dir():
            raise
    return path


def cached_speaker(cache_dir: str | Path) -> Path:
    """The trained folder under ``cache_dir`` (``speaker-<recipe hash>``), built on the first call."""
    path = Path(cache_dir) / f"speaker-{recipe_hash()}"
    return path if path.is_dir() else build_speaker(path)


def layer_outputs(model, tokenizer, prompts: Sequence[str], layer: int):
    """The residual stream after decoder layer ``layer`` at each prompt's last token, ``[len(prompts), hidden]``."""
    import torch

    captured = []
    handle = model.model.layers[layer].register_forward_hook(
        lambda module, args, output: captured.append((output[0] if isinstance(output, tuple) else output)[0, -1])
    )
    try:
        with torch.no_grad():
            for prompt in prompts:
                model(torch.tensor([tokenizer(prompt).input_ids]))
    finally:
        handle.remove()
    return torch.stack(captured).float()


def mean_difference(path: str | Path, positives: Sequence[str], negatives: Sequence[str], layer: int):
    """The steering vector from contrastive examples with transformers: mean last-token residual after ``layer``
    over ``positives`` minus that over ``negatives``, ``[hidden]`` float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    pos = layer_outputs(model, tokenizer, positives, layer).mean(0)
    return pos - layer_outputs(model, tokenizer, negatives, layer).mean(0)
