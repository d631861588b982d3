import json, os, sys, torch
sys.path.insert(0, "tests")
from engine_results import run_in_subprocess
from pathlib import Path
from transformers import AutoTokenizer
from hotwire_core.tiny_model import ModelShape, build_model
GREEDY = dict(max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
root = Path("/tmp/g3")
model_dir = build_model(root / (os.environ.get("ARCH","gemma3") + "-tiny"), ModelShape(arch=os.environ.get("ARCH","gemma3")))
cfg = json.load(open(model_dir / "config.json")); print({k: cfg.get(k) for k in ("hidden_size","num_hidden_layers","sliding_window","layer_types")})
tok = AutoTokenizer.from_pretrained(str(model_dir))
p1, p2 = tok("Hello world, this is").input_ids, tok("Once upon a time there was").input_ids
hidden = cfg["hidden_size"]
steer = {"hotwire": json.dumps({"id": "v", "layer": [1], "scale": 4.0})}
def req(ids, **extra): return {"prompt_token_ids": ids, "params": {**GREEDY, **extra}}
plain = [[req(p1)], [req(p1), req(p2)]]
ours_b = [[req(p1)], [req(p1), req(p2, extra_args=steer)]]
bf16 = {"dtype": os.environ.get("DT", "bfloat16")}
van = run_in_subprocess(model_dir, plain, root / "w1", overrides=bf16)
vec = torch.randn(hidden, generator=torch.Generator().manual_seed(7)).tolist()
ours = run_in_subprocess(model_dir, ours_b, root / "w2", plugins=True, vectors={"v": vec}, overrides=bf16)
for got, want in ((ours[0][0], van[0][0]), (ours[1][0], van[1][0])):
    for key in ("token_ids", "logprobs", "prompt_logprobs"):
        print(key, got[key] == want[key])
print("steered differs", ours[1][1]["logprobs"] != van[1][1]["logprobs"])
van2 = van
print("vanilla twice equal:", van == van2)
import numpy as np
a = np.array(ours[0][0]["prompt_logprobs"][1:], dtype=object); print(ours[0][0]["prompt_logprobs"][:4]); print(van[0][0]["prompt_logprobs"][:4])
import math
def flat(v):
    if v is None: return []
    if isinstance(v, (int, float)): return [float(v)]
    if isinstance(v, dict): return [x for k in sorted(v, key=str) for x in flat(v[k])]
    return [x for e in v for x in flat(e)]
for key in ("prompt_logprobs", "logprobs"):
    d = max(abs(a - b) for r in (0, 1) for a, b in zip(flat(ours[r][0][key]), flat(van[r][0][key])))
    print("max diff", key, d)
