"""Host time of admitting one steered request in the engine core (no GPU, no engine: the controller alone).

vLLM builds a ``Request`` (hashing its prompt's blocks for the prefix cache), then hotwire's controller admits
it: parses the spec, pins its bank rows, salts the cache and, if the request was hashed without that salt, hashes
its blocks again. hotwire's ``preprocess_add_request`` hook gives a steered request its salt before vLLM hashes
it (``presalted``), as the engine does; ``salted late`` is admission of a request built without it. Each
figure is the median of several timings of build + admit + release, per request.

    python benchmarks/bench_admission.py --prompts 16,1024
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import timeit

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from hotwire_core.admission import ModelInfo
from hotwire_core.controller import USER_SALT_ATTR, SteeringController
from hotwire_core.offline import steer
from hotwire_core.settings import Settings
from hotwire_core.tiny_model import SHAPES
from hotwire_core.vllm_glue.requests import VLLM_REQUESTS

BLOCK = 16  # vLLM's default block size


def controller(shape: str) -> SteeringController:
    s = SHAPES[shape]
    c = SteeringController(ModelInfo(True, "", s.num_layers, s.hidden_size, "bfloat16", frozenset(range(s.num_layers))),
                           Settings(256, 4, "op", None, None), "bench", VLLM_REQUESTS)
    vector = torch.randn(s.hidden_size).to(torch.bfloat16)
    assert c.register("v", vector.view(torch.int16).numpy().tobytes(), "bfloat16", [s.hidden_size])["ok"]
    return c


def per_request_us(c: SteeringController, prompt_len: int, mode: str, number: int) -> float:
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BLOCK, sha256_cbor)
    layer = max(c.model.layers) // 2
    params = SamplingParams(max_tokens=64, extra_args=None if mode == "plain" else steer({"id": "v", "layer": layer, "scale": 1.0}))
    prompt = [10 + i % 30000 for i in range(prompt_len)]
    ids = itertools.count()

    def one() -> None:
        salt = c.cache_salt_for(params.extra_args["hotwire"], None, prompt_len) if mode == "presalted" else None
        request = Request(f"r{next(ids)}", prompt, params, None, cache_salt=salt, block_hasher=hasher)
        if salt is not None:
            setattr(request, USER_SALT_ATTR, None)
        c.admit(request)
        c.release(request.request_id)
        c.take_writes()

    return statistics.median(timeit.repeat(one, number=number, repeat=5)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="16,1024", help="prompt lengths in tokens")
    parser.add_argument("--shape", default="qwen3-4b")
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    c = controller(args.shape)
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, shape {args.shape}")
    modes = ("plain", "salted late", "presalted")
    print("| prompt tokens | " + " | ".join(f"{m} (µs/request)" for m in modes) + " |\n|---|" + "---|" * len(modes))
    for n in (int(x) for x in args.prompts.split(",")):
        cells = [per_request_us(c, n, m, max(args.number * 16 // n, 20)) for m in modes]
        print(f"| {n} | " + " | ".join(f"{x:.1f}" for x in cells) + " |")


if __name__ == "__main__":
    main()
