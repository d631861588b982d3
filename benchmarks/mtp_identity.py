"""Where a plain request's logprobs under MTP speculation move on a GPU: the tiny MiMo of
``tests/integration/test_speculative_mtp.py`` (its MTP layer proposing token ``--token``), two plain prompts, each
engine a fresh interpreter, all at once. Prints every engine's pairwise largest logprob difference against the first
plugin-free MTP engine, and writes the results as JSON.

    python3 benchmarks/mtp_identity.py --out mtp_identity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "integration")]

from engine_results import engine_kwargs, max_diff  # noqa: E402
from hotwire_core.verify.plugin_free import run_engine  # noqa: E402
from speculation_cases import GREEDY, K, prompt_ids  # noqa: E402
from test_speculative_mtp import add_mtp_layer, build_mimo  # noqa: E402

MTP = {"method": "mtp", "num_speculative_tokens": K}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--token", type=int, default=375, help="the token the MTP layer proposes")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", help="comma-separated engines to run (default: all; vanilla_mtp always runs)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    path = build_mimo(root / "mimo", root)
    add_mtp_layer(path, args.token)
    prompts = prompt_ids(path)

    def batches(prompt_logprobs: bool) -> list:
        params = {k: v for k, v in GREEDY.items() if prompt_logprobs or k != "prompt_logprobs"}
        return [[{"prompt_token_ids": prompts[p], "params": params}] for p in "ab"]

    # name: (plugin-free, speculation, prompt logprobs, environment[, engine arguments])
    # The *_layers and *_eager jobs tell which hooks move plain requests, and whether compiling does (the hook after
    # the last layer of a model that adds that layer's output itself can: vllm_glue.layers.MODEL_ADD).
    jobs = {
        "vanilla_mtp": (True, True, True, {}),
        "vanilla_mtp_again": (True, True, True, {}),
        "vanilla_nospec": (True, False, True, {}),
        "hotwire_mtp_readout": (False, True, True, {"HOTWIRE_READOUT": "1"}),
        "hotwire_mtp": (False, True, True, {}),
        "hotwire_nospec": (False, False, True, {}),
        "vanilla_mtp_no_prompt_lp": (True, True, False, {}),
        "hotwire_mtp_no_prompt_lp": (False, True, False, {}),
        "hotwire_nospec_layers_0_2": (False, False, True, {"HOTWIRE_LAYERS": "0-2"}),
        "hotwire_nospec_layer_3": (False, False, True, {"HOTWIRE_LAYERS": "3"}),
        "vanilla_nospec_eager": (True, False, True, {}, {"enforce_eager": True}),
        "hotwire_nospec_eager": (False, False, True, {}, {"enforce_eager": True}),
    }

    if args.only:
        keep = {"vanilla_mtp", *args.only.split(",")}
        jobs = {name: job for name, job in jobs.items() if name in keep}

    def run(name: str) -> list:
        plugin_free, spec, prompt_lp, env, *more = jobs[name]
        engine = {"model": str(path), **engine_kwargs(), **({"speculative_config": dict(MTP)} if spec else {}),
                  **(more[0] if more else {})}
        work = root / name
        work.mkdir()
        return run_engine(engine, batches(prompt_lp), work, plugin_free=plugin_free,
                          env={**env, "VLLM_CACHE_ROOT": str(work / "cache")}, tag=name)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(run, jobs)))
    ref = results["vanilla_mtp"]
    report = {}
    for name, res in results.items():
        row = {}
        for n, label in enumerate("ab"):
            got, want = res[n][0], ref[n][0]
            row[label] = {"tokens_equal": got["token_ids"] == want["token_ids"],
                          "logprobs": max_diff(got["logprobs"], want["logprobs"]),
                          "positions_apart": [i for i, (x, y) in enumerate(zip(got["logprobs"], want["logprobs"]))
                                              if x != y],
                          "prompt_logprobs": (max_diff(got["prompt_logprobs"], want["prompt_logprobs"])
                                              if got.get("prompt_logprobs") and want.get("prompt_logprobs") else None)}
        report[name] = row
        print(f"{name:28s} vs vanilla_mtp: {json.dumps(row)}")
    nospec = results.get("vanilla_nospec")
    for name in ("hotwire_nospec", "hotwire_mtp", "vanilla_mtp", "hotwire_nospec_layers_0_2", "hotwire_nospec_layer_3"):
        if nospec is None or name not in results:
            continue
        d = [max_diff(results[name][n][0]["logprobs"], nospec[n][0]["logprobs"]) for n in range(2)]
        print(f"{name:28s} vs vanilla_nospec: logprobs {d}")
        report[f"{name}_vs_vanilla_nospec"] = d
    if "vanilla_nospec_eager" in results and "hotwire_nospec_eager" in results:
        d = [max_diff(results["hotwire_nospec_eager"][n][0]["logprobs"], results["vanilla_nospec_eager"][n][0]["logprobs"])
             for n in range(2)]
        print(f"{'hotwire_nospec_eager':28s} vs vanilla_nospec_eager: logprobs {d}")
        report["hotwire_nospec_eager_vs_vanilla_nospec_eager"] = d
    if args.out:
        args.out.write_text(json.dumps({"report": report, "results": results}))


if __name__ == "__main__":
    main()
