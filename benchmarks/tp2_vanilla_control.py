"""Control for verify's check (e) at tensor parallel 2: N (default two) plugin-free vLLM engines (VLLM_PLUGINS="", each with
its own compile cache, started at the same time on the same GPUs) run exactly the plain requests verify compares
(its short prompts, and its two 72-token prompts at block size 16), and the largest logprob difference between
each engine and the first is printed per request. A non-zero difference here is vLLM's own run-to-run variation,
not hotwire's. The runner is vLLM's choice (VLLM_USE_V2_MODEL_RUNNER=0 for V1).

    python benchmarks/tp2_vanilla_control.py [N]   # on the device, after `source .gpu/env.sh`; needs 2 GPUs

Writes the model, the job and both engines' logs under /tmp/ctl.
"""
import json, os, subprocess, sys
from pathlib import Path
from transformers import AutoTokenizer
from hotwire_core.tiny_model import build_model, ModelShape
from hotwire_core import verify as v
d = Path('/tmp/ctl'); d.mkdir(exist_ok=True)
m = str(build_model(d / 'm', ModelShape(arch='qwen3')))
tok = AutoTokenizer.from_pretrained(m)
short = [tok.encode(p) for p in v.PROMPTS]
x, y = (v.long_prompt(tok, t, v.PREFIX_BLOCKS * 16 + 8) for t in v.LONG_TEXTS)
kw = v.engine_kwargs(m, 'bfloat16', 2, 1.0, untimed=True)
batches = [(short[:1], v.SHORT_TOKENS), (short, v.SHORT_TOKENS), ([x], v.PREFIX_TOKENS), ([y], v.PREFIX_TOKENS)]
job = d / 'job.json'; job.write_text(json.dumps({'engine': kw, 'batches': batches}))
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
procs = []
for i in range(n):
    env = {**os.environ, 'VLLM_PLUGINS': '', 'VLLM_CACHE_ROOT': f'/tmp/ctlc{i}', 'HF_HUB_OFFLINE': '1'}
    procs.append(subprocess.Popen([sys.executable, '-m', 'hotwire_core.verify', '--vanilla-job', str(job), str(d / f'out{i}.json')],
                                  env=env, stdout=open(d / f'log{i}', 'w'), stderr=subprocess.STDOUT))
for p in procs: p.wait()
first, *others = (json.loads((d / f'out{i}.json').read_text()) for i in range(n))
for e, other in enumerate(others, start=1):
    for i, (r, s) in enumerate(zip(first, other)):
        print('engine', e, 'vs 0: request', i, 'same tokens', r['token_ids'] == s['token_ids'],
              'max |dlogprob|', max(abs(p - q) for p, q in zip(r['logprobs'], s['logprobs'])))
