"""Requests through a vLLM engine in a fresh interpreter, plugin-free or with hotwire: the reference behind every
"bit-identical to vLLM without hotwire" claim, one runner for ``verify`` (check e), the tests and the benchmarks.

Plugin-free means ``VLLM_PLUGINS=""``: vLLM loads no plugin, so no hotwire hook runs in any of the engine's
processes (the child checks that, and that hotwire *is* loaded when asked for). A job is JSON::

    {"engine": {LLM keyword arguments}, "plugin_free": true, "vectors": {"id": [floats], ...},
     "batches": [[{"prompt_token_ids": [...], "params": {SamplingParams keyword arguments},
                  "lora": [name, int id, adapter path] (optional: the request runs with that LoRA adapter)},
                 ...], ...]}

(``vectors`` are registered first, with hotwire loaded; ``lora`` needs ``"enable_lora": true`` in ``engine``). A
request with an image gives ``"prompt"`` (text, where the model's processor finds the image's placeholder) instead of
``prompt_token_ids``, and ``"image"``: its pixels, height x width x RGB values 0-255 as nested lists. The
answer holds, per batch and request, ``hotwire_core.vllm_glue.offline.summarize`` of its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Request", "run_batches", "run_engine", "run_here"]

Request = dict[str, Any]  # {"prompt_token_ids": [...] | "prompt": str, "params": {...}, "lora"?: [...], "image"?: [...]}


def run_batches(llm: Any, batches: list[list[Request]]) -> list[list[dict[str, Any]]]:
    """Each batch through ``llm.generate`` at once, in order, each request with its LoRA adapter if it names one;
    ``summarize`` of every output."""
    from hotwire_core.vllm_glue.offline import lora_request, sampling_params, summarize

    results = []
    for batch in batches:
        prompts = [_prompt(r) for r in batch]
        params = [sampling_params(**r["params"]) for r in batch]
        loras = [lora_request(*r["lora"]) if r.get("lora") else None for r in batch]
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras if any(loras) else None)
        results.append([summarize(o) for o in outputs])
    return results


def _prompt(request: Request) -> dict[str, Any]:
    if "image" not in request:
        return {"prompt_token_ids": request["prompt_token_ids"]}
    import numpy as np
    from PIL import Image

    image = Image.fromarray(np.array(request["image"], dtype=np.uint8))
    return {"prompt": request["prompt"], "multi_modal_data": {"image": image}}


def run_engine(
    engine: Mapping[str, Any],
    batches: list[list[Request]],
    workdir: Path,
    *,
    plugin_free: bool = True,
    vectors: Mapping[str, list[float]] | None = None,
    env: Mapping[str, str] | None = None,
    tag: str | None = None,
    timeout_s: float | None = 900,
) -> list[list[dict[str, Any]]]:
    """Run ``batches`` in a fresh interpreter (environment: this one's, with ``env`` over it) and return the
    results. Raises :class:`RuntimeError` with the end of the child's stderr when it fails."""
    tag = tag or ("vanilla" if plugin_free else "hotwire")
    job, out = workdir / f"{tag}-job.json", workdir / f"{tag}-out.json"
    job.write_text(json.dumps({"engine": dict(engine), "batches": batches, "plugin_free": plugin_free,
                               "vectors": dict(vectors or {})}))  # fmt: skip
    child_env = {**os.environ, **(env or {})}
    if plugin_free:
        child_env["VLLM_PLUGINS"] = ""
    else:
        child_env.pop("VLLM_PLUGINS", None)
    command = [sys.executable, "-m", "hotwire_core.verify.plugin_free", str(job), str(out)]
    proc = subprocess.run(command, env=child_env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the {tag} engine failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def run_here(job: Mapping[str, Any]) -> list[list[dict[str, Any]]]:
    """A job in this process (whose environment decides which plugins vLLM loads)."""
    from hotwire_core.vllm_glue import installed
    from hotwire_core.vllm_glue.offline import start_llm

    llm = start_llm(**job["engine"])
    loaded = installed()  # the glue is imported here either way; vLLM's plugin loader installs its hooks
    plugin_free = job.get("plugin_free", True)
    if loaded == plugin_free:
        raise SystemExit("hotwire was loaded although VLLM_PLUGINS is empty" if loaded else
                         "hotwire was not loaded: is hotwire-vllm installed and VLLM_PLUGINS unset?")  # fmt: skip
    if job.get("vectors"):
        import torch

        from hotwire_core.offline import register_vector

        for name, values in job["vectors"].items():
            register_vector(llm, name, torch.tensor(values))
    return run_batches(llm, job["batches"])


if __name__ == "__main__":
    job_path, out_path = sys.argv[1:3]
    Path(out_path).write_text(json.dumps(run_here(json.loads(Path(job_path).read_text()))))
