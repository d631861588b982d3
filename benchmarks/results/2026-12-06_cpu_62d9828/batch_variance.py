"""Plugin-free vLLM (VLLM_PLUGINS="") on the CPU: one request alone, then beside three batchmates, then beside three
other batchmates of the same lengths; are its logprobs the same bits? Output: batch_variance.txt.

    python benchmarks/results/2026-12-06_cpu_62d9828/batch_variance.py
"""
import os
os.environ["VLLM_PLUGINS"] = ""
from pathlib import Path
if __name__ == "__main__":
    from hotwire_core.tiny_model import build_model
    model = build_model(Path("/tmp/batch-variance/tiny"), "tiny", weights=True)
    from vllm import LLM, SamplingParams
    llm = LLM(str(model), dtype="float32", max_model_len=512, max_num_seqs=8, block_size=32, seed=0, enable_prefix_caching=False)
    p = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    a = {"prompt_token_ids": list(range(100, 140))}
    others = [{"prompt_token_ids": list(range(200 + 7 * i, 230 + 7 * i))} for i in range(3)]
    alone = llm.generate([a], [p], use_tqdm=False)[0]
    mixed = llm.generate(others + [a], [p] * 4, use_tqdm=False)[-1]
    others2 = [{"prompt_token_ids": list(range(300 + 5 * i, 330 + 5 * i))} for i in range(3)]
    mixed2 = llm.generate(others2 + [a], [p] * 4, use_tqdm=False)[-1]
    def lp(o): return [list(d.values())[0].logprob for d in o.outputs[0].logprobs]
    print("alone ", lp(alone))
    print("batch ", lp(mixed))
    print("batch2", lp(mixed2))
    print("alone==batch", lp(alone) == lp(mixed), "batch==batch2", lp(mixed) == lp(mixed2))
