"""Run from the repository root on the device (`python3 moe_probe.py`, beside `gpu_checks.sh configs`): a tiny
Qwen3-MoE (8 experts, top-2, random weights) through vLLM with hotwire, one plain and one steered request."""
import json
from pathlib import Path


def main():
    import torch, transformers
    from hotwire_core.tiny_model import _write_tokenizer
    path = Path("/tmp/moe-tiny"); path.mkdir(exist_ok=True)
    cfg = transformers.Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096, initializer_range=0.02, bos_token_id=0, eos_token_id=0, pad_token_id=0, decoder_sparse_step=1, mlp_only_layers=[])
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.float32).save_pretrained(str(path))
    _write_tokenizer(path, 512)
    from vllm import LLM, SamplingParams
    from hotwire_core.offline import register_vector, slot_stats
    llm = LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=1<<30, gpu_memory_utilization=0.05)
    print("MODEL", json.dumps(slot_stats(llm)["model"])[:400])
    register_vector(llm, "v", torch.randn(256))
    sp = [SamplingParams(max_tokens=4, temperature=0, logprobs=0), SamplingParams(max_tokens=4, temperature=0, logprobs=0, extra_args={"hotwire": json.dumps({"id": "v", "layer": 1, "scale": 4})})]
    out = llm.generate(["The quick brown fox"] * 2, sp, use_tqdm=False)
    for o in out: print("OUT", o.outputs[0].token_ids, [round(d[t].logprob, 4) for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
    try:
        import numba; print("numba", numba.__version__)
    except Exception as e: print("no numba", e)

if __name__ == "__main__":
    main()
