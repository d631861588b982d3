"""The cases every form of speculative decoding must pass under hotwire, on vLLM 0.25.1's CPU build (V1 runner).
A test file imports them all and defines the module fixture ``speculative_config`` (vLLM's, with ``K`` drafts per
step): one file per method keeps each file's three engine starts within the suite's budget per file.

With speculation a decoding request runs 1 + k tokens per step (its last sampled token and k drafts), all at
positions past its prompt: hotwire steers them with the request's decode config, so a steered greedy request
gives the tokens it gives without speculation, ``decode_only`` / ``prefill_only`` included. The draft side is
left plain: n-gram drafting runs no model, and a draft model's or an EAGLE head's layers are not hooked (hotwire
hooks the target's decoder layers only), which costs acceptance, never correctness: every token is the target's,
verified steered.

Per method one engine with hotwire (the test process), one plugin-free engine with the same speculation, and one
engine with hotwire and no speculation (the reference for steered requests), each a fresh interpreter.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine_results import CPU_REPEAT_TOLERANCE, engine_kwargs, max_diff, run_batches, run_in_subprocess

__all__ = [
    "batches", "engine", "prompts", "unspeculated", "vector",
    "test_decode_only_and_prefill_only_split_at_the_prompt",
    "test_plain_requests_are_bit_identical_to_a_plugin_free_engine_with_the_same_speculation",
    "test_readouts_under_speculation_equal_transformers_hooks",
    "test_steered_requests_equal_the_same_requests_without_speculation",
    "test_the_target_is_steerable_and_only_its_layers_are_hooked",
]

HIDDEN = 256
GREEDY = dict(max_tokens=24, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
ENTRY = {"id": "v", "layer": [1, 2], "scale": 2.0}
K = 3


def spec(**extra) -> dict:
    return {"hotwire": json.dumps({**ENTRY, **extra})}


@pytest.fixture(scope="module")
def vector() -> list[float]:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def prompts(tiny_model) -> dict[str, list[int]]:
    return prompt_ids(tiny_model)


def prompt_ids(model_dir) -> dict[str, list[int]]:
    """The two prompts every engine runs, as ``model_dir``'s tokenizer encodes them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return {"a": tok(" ".join(["steering vectors nudge the residual stream"] * 4)).input_ids,
            "b": tok("The quick brown fox jumps over the lazy dog. The quick brown fox").input_ids}  # fmt: skip


def req(ids: list[int], **extra) -> dict:
    return {"prompt_token_ids": ids, "params": {**GREEDY, **extra}}


@pytest.fixture(scope="module")
def batches(prompts) -> list[list[dict]]:
    """What every engine runs: plain, steered (whole, decode_only, prefill_only, weakly), and a mixed batch."""
    a, b = prompts["a"], prompts["b"]
    return [
        [req(a)],
        [req(b)],
        [req(a, extra_args=spec())],
        [req(b, extra_args=spec())],
        [req(a, extra_args=spec(decode_only=True))],
        [req(a, extra_args=spec(prefill_only=True))],
        [req(a, extra_args=spec(scale=0.02))],
        [req(b), req(a, extra_args=spec()), req(b, extra_args=spec(decode_only=True)), req(a)],
    ]


# WEAK steers so little that about half its tokens stay the plain ones: a draft model's unsteered drafts are then
# accepted in part, so its verification tokens past the first are kept too.
PLAIN, PLAIN_B, STEERED, STEERED_B, DECODE_ONLY, PREFILL_ONLY, WEAK, MIXED = range(8)
STEERED_ALONE = (STEERED, STEERED_B, DECODE_ONLY, PREFILL_ONLY, WEAK)


@pytest.fixture(scope="module")
def unspeculated(tiny_model, batches, vector, tmp_path_factory) -> list[list[dict]]:
    """The same batches through hotwire without speculation: what each request must come out as."""
    return run_in_subprocess(tiny_model, batches, tmp_path_factory.mktemp("no-spec"), plugins=True,
                             vectors={"v": vector})  # fmt: skip


@pytest.fixture(scope="module")
def engine(speculative_config, tiny_model, vector, batches):
    """The engine with hotwire and speculation, and per batch its results and (drafted, accepted) tokens."""
    from vllm import LLM

    from hotwire_core.offline import register_vector

    # a copy: vLLM adds its config objects to the dict it is given. Readout on (read at start; later modules must not
    # inherit it): the plain requests' bit identity holds with its op compiled in too.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HOTWIRE_READOUT", "1")
        llm = LLM(str(tiny_model), **engine_kwargs(), speculative_config=dict(speculative_config),
                  disable_log_stats=False)
    try:
        register_vector(llm, "v", torch.tensor(vector))
        results, drafts = [], []
        for batch in batches:
            before = draft_counts(llm)
            results += run_batches(llm, [batch])
            after = draft_counts(llm)
            drafts.append((after[0] - before[0], after[1] - before[1]))
        yield {"llm": llm, "results": results, "drafts": drafts}
    finally:
        llm.llm_engine.engine_core.shutdown()


def draft_counts(llm) -> tuple[int, int]:
    """vLLM's counters of draft tokens proposed and accepted so far."""
    values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return tuple(int(values.get(f"vllm:spec_decode_num_{name}_tokens") or 0) for name in ("draft", "accepted"))


def lp_diff(a: dict, b: dict) -> float:
    return max(max_diff(a["logprobs"], b["logprobs"]), max_diff(a["prompt_logprobs"], b["prompt_logprobs"]))


def test_the_target_is_steerable_and_only_its_layers_are_hooked(engine):
    from hotwire_core import contract
    from hotwire_core.offline import slot_stats

    model = slot_stats(engine["llm"])["model"]
    assert model["steerable"] is True, model
    info = engine["llm"].collective_rpc(contract.WORKER_INFO)[0]
    assert info["layers"] == [0, 1, 2, 3] and info["n_layers"] == 4, info  # the target's; the drafter's are not hooked


def test_steered_requests_equal_the_same_requests_without_speculation(engine, unspeculated, speculative_config):
    """Token ids equal; logprobs judged against the floor: how far speculation alone moves the plain requests'
    (other batch shapes round differently on the CPU)."""
    ours, theirs = engine["results"], unspeculated
    floor = max(lp_diff(ours[i][0], theirs[i][0]) for i in (PLAIN, PLAIN_B))
    tolerance = max(4 * floor, 1e-5)
    for i in (PLAIN, PLAIN_B):
        assert ours[i][0]["token_ids"] == theirs[i][0]["token_ids"]
    worst = 0.0
    for i in (*STEERED_ALONE, MIXED):
        for n, (got, want) in enumerate(zip(ours[i], theirs[i])):
            assert got["token_ids"] == want["token_ids"], f"batch {i} request {n}: tokens differ with speculation"
            diff = lp_diff(got, want)
            assert diff <= tolerance, f"batch {i} request {n}: logprobs differ by {diff} (floor {floor})"
            worst = max(worst, diff)
    print(f"{speculative_config['method']}: speculation moves plain logprobs by {floor:.2e}, steered ones by "
          f"{worst:.2e} (drafted, accepted per batch: {engine['drafts']})")
    # The steering is far above that tolerance, and speculation ran on the steered requests: drafts were
    # verified, some accepted (verification tokens past the first one were steered and kept), some rejected.
    for i in (STEERED, WEAK):
        assert max_diff(ours[i][0]["logprobs"], ours[PLAIN][0]["logprobs"]) > 100 * tolerance
    drafted, accepted = (sum(engine["drafts"][i][j] for i in STEERED_ALONE) for j in (0, 1))
    assert 0 < accepted < drafted, engine["drafts"]


def test_decode_only_and_prefill_only_split_at_the_prompt(engine):
    """Verification tokens are decode tokens: decode_only steers them (its prompt is plain), prefill_only does not
    (its prompt is steered like the whole spec's)."""
    r = engine["results"]
    plain, whole, decode, prefill = (r[i][0] for i in (PLAIN, STEERED, DECODE_ONLY, PREFILL_ONLY))
    # The prompt and the first sampled token (from the prompt's last position) as in the other phase's request, to
    # the CPU's run-to-run rounding (the first token's logprob was seen to move by 5e-7 between runs).
    for got, want in ((decode, plain), (prefill, whole)):
        first = max_diff(got["prompt_logprobs"] + got["logprobs"][:1], want["prompt_logprobs"] + want["logprobs"][:1])
        assert first < 1e-5
    assert max_diff(decode["logprobs"][1:], plain["logprobs"][1:]) > 1e-3, "decode_only left verification tokens plain"
    assert max_diff(prefill["logprobs"][1:], whole["logprobs"][1:]) > 1e-3, "prefill_only steered verification tokens"


def test_plain_requests_are_bit_identical_to_a_plugin_free_engine_with_the_same_speculation(
    engine, unspeculated, speculative_config, tiny_model, prompts, tmp_path
):
    """Tokens and logprobs as plugin-free vLLM's with the same speculation. Prompt logprobs as computed without
    speculation: under CUDA graphs vLLM 0.25.1 computes them after a drafter that runs a model may have overwritten
    the target's hidden states (vLLM #53488), which hotwire keeps for them (``vllm_glue.speculation``); how far
    plugin-free vLLM's are from those values is printed, not judged."""
    a, b = prompts["a"], prompts["b"]
    vanilla = run_in_subprocess(tiny_model, [[req(a)], [req(b)], [req(b), req(a), req(b), req(a)]], tmp_path,
                                overrides={"speculative_config": speculative_config})
    ours = engine["results"]
    bound = 0.0 if torch.cuda.is_available() else CPU_REPEAT_TOLERANCE  # two engines: the CPU's rounding
    for n, i in enumerate((PLAIN, PLAIN_B)):
        got, want, alone = ours[i][0], vanilla[n][0], unspeculated[i][0]
        assert got["token_ids"] == want["token_ids"], "plain request tokens differ from vLLM without hotwire"
        diff = max_diff(got["logprobs"], want["logprobs"])
        assert got["logprobs"] == want["logprobs"], f"plain request logprobs differ from vLLM without hotwire by {diff}"
        diff = max_diff(got["prompt_logprobs"], alone["prompt_logprobs"])
        assert diff <= bound, f"plain request prompt logprobs differ from those without speculation by {diff}"
        theirs = max_diff(want["prompt_logprobs"], alone["prompt_logprobs"])
        print(f"{speculative_config['method']}: prompt logprobs from those without speculation: plugin-free vLLM's "
              f"{theirs:.2e}, hotwire's {diff:.2e}")
    # Beside steered batchmates (whose drafts, and so the batch's shape, differ from plain ones'): tokens equal,
    # logprobs to float32 rounding; prompt logprobs as in the same batch without speculation.
    for n in (0, 3):
        got, want = ours[MIXED][n], vanilla[2][n]
        assert got["token_ids"] == want["token_ids"]
        diff = max(max_diff(got["logprobs"], want["logprobs"]),
                   max_diff(got["prompt_logprobs"], unspeculated[MIXED][n]["prompt_logprobs"]))
        assert diff < 1e-5, f"plain batchmate {n} moved by {diff}"


def test_readouts_under_speculation_equal_transformers_hooks(engine, tiny_model, prompts, vector):
    """A verification step computes 1 + k positions of a request, and a rejected draft's position is computed again
    with the token that replaced it: each generated token is read where it was predicted, the value the forward of
    the accepted token gave (the latest at its position), steered as decode tokens are. Against transformers with
    hooks on the prompt and the tokens the engine generated."""
    import numpy as np
    from vllm import SamplingParams

    import hf_reference
    from hotwire_core.offline import generate_with_readout, steer

    llm, v = engine["llm"], torch.tensor(vector)
    # Steered and plain: n-gram drafts of the steered requests are all accepted (they repeat themselves), the plain
    # ones' are rejected in part.
    cases = [(key, steered) for key in ("a", "b") for steered in (True, False)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             extra_args=steer(ENTRY) if steered else None) for _, steered in cases]
    before = draft_counts(llm)
    outs = generate_with_readout(llm, [{"prompt_token_ids": prompts[key]} for key, _ in cases], params,
                                 [{"id": "v", "layer": 2}], tokens="all")
    drafted, accepted = (after - was for after, was in zip(draft_counts(llm), before))
    hf_model = hf_reference.load(tiny_model)
    # float32 on the CPU: within 1e-5 of the largest score. On a GPU the engine runs bf16 against transformers'
    # float32, so a score's error scales with |stream| |probe| (test_readout.py's bound: 2% of that product).
    on_gpu = torch.cuda.is_available()
    worst, where = 0.0, None
    for (key, steered), out in zip(cases, outs):
        steering = [(layer, v, ENTRY["scale"]) for layer in ENTRY["layer"]] if steered else []
        prompt, generated = prompts[key], list(out.outputs[0].token_ids)
        stream = hf_reference.layer_outputs(hf_model, prompt + generated[:-1], [2], steering)[2]
        (probe,) = out.hotwire_readout["probes"]
        P = len(prompt)
        for part, rows in (("prompt", stream[:P]), ("generated", stream[P - 1 : P - 1 + len(generated)])):
            want = (rows @ v).numpy()
            got = np.array(probe[part]["score"])
            assert got.shape == want.shape, (key, steered, part)
            scale = (rows.norm(dim=-1) * v.norm()).max() if on_gpu else np.abs(want).max()
            apart = float(np.abs(got - want).max() / scale)
            if apart > worst:
                worst, where = apart, f"prompt {key}, {'steered' if steered else 'plain'}, {part} tokens"
    print(f"readout under speculation vs transformers + hooks: {worst:.2e} of the largest "
          f"{'|stream| |probe|' if on_gpu else 'score'}; drafted {drafted}, accepted {accepted}")
    assert worst < (0.02 if on_gpu else 1e-5), f"readouts {worst:.2e} from transformers' (where: {where})"
    assert 0 < accepted < drafted  # verification kept drafts past the first token, and rejected some
