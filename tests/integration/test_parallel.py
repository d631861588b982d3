"""Tensor parallel 2 and pipeline parallel 2 on vLLM 0.25.1's CPU backend: two worker processes (the ``mp``
executor) beside the engine core, the tiny float32 model, one configuration at a time.

What each rank holds: at TP 2 every rank runs every decoder layer on its shard of the weights (the residual
stream is whole again after each layer's all-reduce) and hooks all of them; at PP 2 rank 0 holds layers 0-1 and
rank 1 layers 2-3 (vLLM's ``PPMissingLayer`` stands in the others' places) and each hooks only its own. The engine
here runs with ``HOTWIRE_LAYERS=1,2,3``, so PP rank 0 also holds a layer it does not hook. The engine core judges
every spec once, in ``add_request``, against the union of what the ranks reported at start
(``engine_core.model_info``) and sends the same decision to every rank in the scheduler output: a rank never
decides on a request by itself, so no rank can refuse a request another rank serves. The refusal tests send what
a per-rank judgement would get wrong (a layer only one rank holds and does not hook, a layer past the model, an
unknown vector) beside requests that are served, under a deadline: a hang would end them, not the job's timeout.

vLLM's default thread binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) gives each rank a NUMA node of its own and
refuses to start two ranks on a machine with one (``vllm/utils/ompmultiprocessing.py``); ``nobind`` (what
``scripts/test.sh`` sets) lets both run.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import hf_reference
from engine_results import assert_same_result, engine_kwargs, run_batches, run_in_subprocess

pytestmark = pytest.mark.integration

HIDDEN = 256
PARALLEL = {
    "tp2": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    "pp2": {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"},
}
# Layers each rank holds and hooks under HOTWIRE_LAYERS=1,2,3 (hotwire_worker_info, in rank order).
HOOKED = {"tp2": [[1, 2, 3], [1, 2, 3]], "pp2": [[1], [2, 3]]}
GREEDY = dict(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
# Over both PP stages: rank 0's layer 1, rank 1's layers 2 and 3, two vectors stacked on layer 3.
SPANNING = [{"id": "a", "layer": [1, 2, 3], "scale": 2.0}, {"id": "b", "layer": 3, "scale": -3.0}]
# The dense tests' bound: float32 vLLM against float32 transformers + hook.
TOLERANCE = 2e-3
DEADLINE_S = 120  # a few seconds of work here; a rank waiting on another forever would stop at this


def spec(entries) -> dict:
    return {"hotwire": json.dumps(entries)}


def req(ids: list[int], steering=None, **params) -> dict:
    extra = {"extra_args": spec(steering)} if steering is not None else {}
    return {"prompt_token_ids": ids, "params": {**(params or GREEDY), **extra}}


@contextmanager
def deadline(seconds: int = DEADLINE_S) -> Iterator[None]:
    """Raise TimeoutError in this (the main) thread if the block runs longer than ``seconds``."""

    def expire(signum, frame):
        raise TimeoutError(f"the engine did not answer within {seconds} s: a rank is waiting on another")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def prompts(tiny_model) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    texts = {"fox": "The quick brown fox jumps over", "hello": "Hello world, this is"}
    return {name: tok(text).input_ids for name, text in texts.items()}


@pytest.fixture(scope="module")
def vectors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(37)
    return {"a": torch.randn(HIDDEN, generator=g), "b": torch.randn(HIDDEN, generator=g)}


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return hf_reference.load(tiny_model)


def plain_batches(prompts) -> list[list[dict]]:
    """Alone; then the pair whose second request the hotwire engine steers (here unsteered)."""
    return [[req(prompts["fox"])], [req(prompts["hello"]), req(prompts["fox"])]]


@pytest.fixture(scope="module", params=list(PARALLEL))
def parallel(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def vanilla(tiny_model, prompts, parallel, tmp_path_factory):
    """Plugin-free vLLM with the same parallelism (TP changes the numerics: the reference must share it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        return run_in_subprocess(tiny_model, plain_batches(prompts), tmp_path_factory.mktemp(f"vanilla-{parallel}"),
                                 overrides=PARALLEL[parallel])


@pytest.fixture(scope="module")
def llm(tiny_model, vectors, parallel, vanilla):
    """hotwire's engine, started once ``vanilla`` has finished (one engine at a time on the CPU)."""
    from vllm import LLM

    from hotwire_core.offline import register_vector

    # The engine's processes read these at start; later modules' engines must not inherit them.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        mp.setenv("HOTWIRE_LAYERS", "1,2,3")
        mp.setenv("HOTWIRE_READOUT", "1")  # compiled in: the plain requests' bit identity holds with it too
        engine = LLM(str(tiny_model), **engine_kwargs(), **PARALLEL[parallel])
    try:
        for name, vector in vectors.items():
            register_vector(engine, name, vector)
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()


def test_each_rank_hooks_the_layers_it_holds(llm, parallel):
    from hotwire_core.offline import slot_stats

    ranks = llm.collective_rpc("hotwire_worker_info")
    assert [rank["layers"] for rank in ranks] == HOOKED[parallel]
    assert all(rank["steerable"] and rank["n_layers"] == 4 for rank in ranks)
    model = slot_stats(llm)["model"]
    assert (model["steerable"], model["n_layers"], model["layers"]) == (True, 4, "1-3")


@pytest.mark.parametrize(
    "entries",
    [[{"id": "a", "layer": 1, "scale": 4.0}], [{"id": "a", "layer": 3, "scale": 4.0}], SPANNING],
    ids=["first-stage", "second-stage", "both-stages"],
)
def test_steering_equals_transformers_hook(llm, hf_model, prompts, vectors, entries):
    ids = prompts["fox"]
    steering = [(layer, vectors[e["id"]], e["scale"], False)
                for e in entries for layer in (e["layer"] if isinstance(e["layer"], list) else [e["layer"]])]
    expected = hf_reference.prompt_logprobs(hf_model, ids, steering)
    plain_expected = hf_reference.prompt_logprobs(hf_model, ids)
    with deadline():
        got, plain = (r[0] for r in run_batches(llm, [[req(ids, entries, **GREEDY)], [req(ids)]]))
    steered_err = (torch.tensor(got["prompt_logprobs"][1:]) - expected).abs().max().item()
    plain_err = (torch.tensor(plain["prompt_logprobs"][1:]) - plain_expected).abs().max().item()
    effect = (expected - plain_expected).abs().max().item()
    print(f"\nsteered error {steered_err:.2e}, plain {plain_err:.2e}, steering effect {effect:.3f}")
    assert plain_err < TOLERANCE, f"plain vLLM differs from transformers by {plain_err}"
    assert steered_err < TOLERANCE, f"steered vLLM differs from transformers + hook: {steered_err} (effect {effect})"
    assert effect > 10 * TOLERANCE, f"the steering in this check is too weak to be seen: {effect}"


def test_readout_across_ranks_equals_transformers_hooks(llm, hf_model, prompts, vectors):
    """Probes at layer 1 (PP: rank 0's) and layer 3 (PP: rank 1's) of a request steered at layer 1: each rank
    returns the probes of the layers it hooks (at TP 2 both return both), merged into one readout."""
    from vllm import SamplingParams

    from hotwire_core.offline import generate_with_readout, steer

    ids = prompts["fox"]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                            extra_args=steer({"id": "a", "layer": 1, "scale": 2.0}))
    with deadline():
        (out,) = generate_with_readout(llm, [{"prompt_token_ids": ids}], params,
                                       [{"id": "a", "layer": 1}, {"id": "b", "layer": 3}], tokens="all")
    generated = list(out.outputs[0].token_ids)
    streams = hf_reference.layer_outputs(hf_model, ids + generated[:-1], [1, 3], [(1, vectors["a"], 2.0)])
    P = len(ids)
    for probe, (name, layer) in zip(out.hotwire_readout["probes"], [("a", 1), ("b", 3)]):
        stream = streams[layer]
        for part, rows in (("prompt", stream[:P]), ("generated", stream[P - 1 : P - 1 + len(generated)])):
            want = rows @ vectors[name]
            err = (torch.tensor(probe[part]["score"]) - want).abs().max().item()
            print(f"{probe['probe']} {part}: readout across ranks vs transformers + hooks: {err:.2e} (largest "
                  f"{want.abs().max().item():.3g})")
            assert err < TOLERANCE * max(1.0, want.abs().max().item())


@pytest.fixture(scope="module")
def served(llm, prompts):
    """``plain_batches`` with the pair's second request steered over both stages."""
    alone, (hello, _) = plain_batches(prompts)
    with deadline():
        return run_batches(llm, [alone, [hello, req(prompts["fox"], SPANNING)]])


def test_plain_and_a_steered_batchmate_bit_identical_to_vllm_without_hotwire(served, vanilla):
    for batch, i in ((0, 0), (1, 0)):
        assert_same_result(served[batch][i], vanilla[batch][i],
                           f"batch {batch}, request {i} against plugin-free vLLM with the same parallelism")
    assert served[1][1]["prompt_logprobs"] != vanilla[1][1]["prompt_logprobs"], "the steered request was not steered"


@pytest.mark.parametrize(
    "entries, code, message",
    [
        ({"id": "a", "layer": 0, "scale": 4.0}, "layer_out_of_range",
         "layer 0 cannot be steered: this server steers layers 1-3 (HOTWIRE_LAYERS; the model has 0-3)"),
        ({"id": "a", "layer": [3, 4], "scale": 4.0}, "layer_out_of_range", "layer 4 cannot be steered"),
        ({"id": "nope", "layer": 3, "scale": 4.0}, "unknown_vector", "nope"),
    ],
    ids=["held-not-hooked", "past-the-model", "unknown-vector"],
)
def test_a_refusal_comes_back_at_once_and_batchmates_are_served(llm, prompts, served, entries, code, message):
    """A layer that rank 0 holds but does not hook, one past the last rank's, an unknown vector: refused by the
    engine core as a whole (the reason names the model's layers, not a rank's), while the requests beside it run
    exactly as they do without it."""
    from hotwire_core.offline import HotwireError, check_steering

    with pytest.raises(HotwireError) as exc:
        check_steering(llm, spec(entries))
    assert (exc.value.status, exc.value.code) == (400, code) and message in exc.value.message
    hello, fox = req(prompts["hello"]), req(prompts["fox"], SPANNING)
    with deadline():
        (batch,) = run_batches(llm, [[hello, fox, req(prompts["fox"], entries)]])
        after = run_batches(llm, [[hello, fox]])[0]
    assert batch[2]["finish_reason"] == "error" and batch[2]["token_ids"] == []
    for i in range(2):
        assert_same_result(batch[i], served[1][i], f"request {i} beside the refused one against without it")
        assert_same_result(after[i], served[1][i], f"request {i} after the refusal against before it")
