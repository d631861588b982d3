"""Self-test of hotwire on your own hardware, in one offline vLLM engine:

    python -m hotwire_core.verify [--model PATH_OR_ID | --arch ARCH] [--dtype DTYPE] [--runner v1|v2] [--vanilla]
                                  [--tensor-parallel-size N] [--kv-cache-gib G] [--save-plain FILE]
                                  [--quantization Q] [--kv-cache-dtype D] [--speculative-config JSON]
                                  [--pipeline-parallel-size N] [--max-num-batched-tokens N] [--lora PATH]

Without ``--model`` it builds the built-in tiny model (random weights, architecture ``--arch``, default qwen3) in
a temporary folder; that also runs on a CPU, slowly. The serving-configuration flags (:mod:`.setup`) are vLLM's
engine arguments of the same names, given to every engine the checks start; ``--lora`` runs every request with
that adapter. A random vector sized to the model is registered and these are checked:

a. steering fires: steered logprobs differ from plain ones;
b. batchmates: plain requests batched with steered ones are bit-identical to the same plain requests in an
   all-plain batch of the same shape;
c. prefix cache, both directions, on prompts of at least 4 KV blocks: a plain request after a steered one (and a
   steered one after a plain one) reads no cached tokens and equals the same request with
   ``skip_reading_prefix_cache``; an identical steered request does hit the cache;
d. decode cost: time per decode step of a batch of 8, idle (hotwire loaded, nothing steered) vs all steered (steered
   may cost at most +50% on a GPU, +200% on the CPU: a guard against gross regressions, not the speed target); with
   CUDA graphs on, every rank must have its hotwire-free graphs (the idle variants) in place after an unsteered step;
e. with ``--vanilla``: the plain requests again, in a subprocess with no plugin at all (``VLLM_PLUGINS=""``),
   compared bit for bit. On a GPU both engines then compile with :data:`UNTIMED_INDUCTOR`: Inductor's
   deterministic mode patched into vLLM's compile (``TORCHINDUCTOR_DETERMINISTIC=1`` does not reach it: Dynamo
   resets the setting after every trace), vLLM's combo kernels always fused (``benchmark_combo_kernel`` off: vLLM turns it on, and deterministic mode
   refuses that timing) and one configuration per pointwise kernel (``triton.autotune_pointwise`` off: a combo
   kernel holding a reduction is emitted as a pointwise one, whose configurations deterministic mode still times).
   Inductor otherwise picks some kernel configurations by timing them, and two compiles on a busy GPU may pick
   differently and differ in the last bits (seen on the H200: tiny Qwen3's q/k RMSNorm, 0.0039 or 4e-5 in a
   logprob). When the plain requests differ, a second plugin-free engine runs
   them too, this time in the order this engine ran them, after the same earlier requests (their steering left
   out), and each request passes if it equals either engine's: at tensor parallel 2 on the V1 runner, plugin-free
   engines running the same requests have disagreed with each other on a 72-token prefill (by 0.0038 or 1.1e-4,
   on the H200: ``benchmarks/tp2_identity.py``), so one reference cannot tell vLLM's own variation from
   hotwire's. The report says where the two references differ.

``--save-plain FILE`` writes the plain results that (e) compares as JSON (compiling as (e) does), so that
engines elsewhere can be compared with this one (``benchmarks/tp2_identity.py``).

"Bit-identical" is exact on a GPU; on the CPU, whose backend jitters by an ulp even between identical batches,
it is within ``CPU_TOLERANCE`` and the report gives the largest difference.

It prints a report and exits 1 when a check fails (2 when hotwire refuses the test vector or steering).
"""

from __future__ import annotations

from hotwire_core.verify.checks import (
    CPU_TOLERANCE,
    Check,
    Result,
    check_batchmates,
    check_cache_hit,
    check_decode_cost,
    check_gates,
    check_no_cross_read,
    check_readout,
    check_steering_fires,
    check_vanilla,
    compare,
    max_abs_diff,
    per_step_ms,
)
from hotwire_core.verify.report import exit_status, format_report
from hotwire_core.verify.runs import (
    UNTIMED_INDUCTOR,
    checks_a_to_c,
    engine_kwargs,
    load_results,
    plain_batches,
    plain_history,
    save_results,
    untimed_compilation_config,
)

# The package: checks (judging, pure), report (header, lines, verdict), runs (the engines), setup (the serving
# configuration's flags), __main__ (the CLI).
__all__ = [
    "CPU_TOLERANCE", "UNTIMED_INDUCTOR", "Check", "Result", "check_batchmates", "check_cache_hit",
    "check_decode_cost", "check_gates", "check_no_cross_read", "check_readout", "check_steering_fires", "check_vanilla",
    "checks_a_to_c", "compare",
    "engine_kwargs", "exit_status", "format_report", "load_results", "max_abs_diff", "per_step_ms",
    "plain_batches", "plain_history", "save_results", "untimed_compilation_config",
]  # fmt: skip
