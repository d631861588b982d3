"""What the engine core's answers to the control plane's reads cost (answered in its busy loop between steps), with
a registry in the state a tenant soak leaves it: ``--current`` vectors over ``--tenants`` namespaces and
``--retained`` retired versions still within ``HOTWIRE_RETAIN_S`` (churn and a flood retire about 17 a second,
each kept 60 s). Times the vector listing (``hotwire_list``) whole and a quota check's (one tenant's namespace),
and the catalog (``hotwire_catalog``) whole and for an API server one registration behind (what it fetches after
every registration). CPU only, no vLLM engine.

    python benchmarks/bench_listing.py --current 60 --retained 1000 --reps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from hotwire_core.admission import ModelInfo
from hotwire_core.controller import SteeringController
from hotwire_core.settings import Settings
from hotwire_core.vllm_glue.requests import VLLM_REQUESTS

N_LAYERS, HIDDEN = 4, 64


def build(current: int, retained: int, tenants: int) -> SteeringController:
    model = ModelInfo(True, "", N_LAYERS, HIDDEN, "float32", frozenset(range(N_LAYERS)))
    controller = SteeringController(model, Settings(64, 2, "op", None, None), "org/model", VLLM_REQUESTS)
    rng = np.random.default_rng(0)

    def register(vector_id: str) -> None:
        data = rng.standard_normal(HIDDEN, dtype=np.float32).tobytes()
        assert controller.register(vector_id, data, "float32", [HIDDEN])["ok"]

    for k in range(current):
        register(f"t{k % tenants}/v{k}")
    for k in range(retained):  # a flood's vectors: registered, then deleted
        register(f"flood/x{k}")
        assert controller.unregister(f"flood/x{k}")["ok"]
    return controller


def timed(controller: SteeringController, args: tuple, reps: int, method: str = "list") -> dict:
    answer = controller.answer(method, args, {})
    if not answer.get("ok"):
        return {"error": answer.get("error")}
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        controller.answer(method, args, {})
        times.append(time.perf_counter() - began)
    return {"vectors": len(answer["vectors"]), "median_ms": round(1e3 * statistics.median(times), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--current", type=int, default=60)
    parser.add_argument("--retained", type=int, default=1000)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    controller = build(args.current, args.retained, args.tenants)
    listing = {"every_vector": timed(controller, (), args.reps), "one_tenant": timed(controller, ("t0",), args.reps)}
    behind = controller.registry.generation
    controller.register("t0/new", np.ones(HIDDEN, np.float32).tobytes(), "float32", [HIDDEN])
    catalog = {"whole": timed(controller, (-1,), args.reps, "catalog"),
               "one_change": timed(controller, (behind,), args.reps, "catalog")}
    print(json.dumps({"current": args.current, "retained": args.retained, "list": listing, "catalog": catalog}))


if __name__ == "__main__":
    main()
