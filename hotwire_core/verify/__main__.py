"""The command line of the self-test: ``python -m hotwire_core.verify --help``."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from hotwire_core.cpu_env import CPU_ENV
from hotwire_core.tiny_model import ARCHS, CPU_BF16_ARCHS, UNSTEERED_ARCHS
from hotwire_core.verify.report import exit_status, format_report
from hotwire_core.verify import setup
from hotwire_core.verify.runs import _vanilla_child, run

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hotwire_core.verify", description="Self-test hotwire in one vLLM engine."
    )
    parser.add_argument("--model", help="model to test (path or hub id); default: the built-in tiny model")
    parser.add_argument("--arch", default="qwen3", choices=[a for a in ARCHS if a not in UNSTEERED_ARCHS],
                        help="architecture of the built-in tiny model (ignored with --model)")
    parser.add_argument("--dtype", help="engine dtype (default: auto on a GPU, float32 on the CPU; bfloat16 for the "
                        f"built-in {', '.join(CPU_BF16_ARCHS)}, which vLLM's CPU build runs in bf16 only)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="tensor parallel ranks (GPUs)")
    parser.add_argument("--kv-cache-gib", type=float,
                        help="a fixed KV cache size instead of vLLM's memory profiling (lets engines share a GPU)")
    parser.add_argument("--runner", choices=("v1", "v2"), help="force vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER)")
    parser.add_argument("--vanilla", action="store_true", help="also compare plain requests with a plugin-free engine")
    parser.add_argument("--save-plain", type=Path, metavar="FILE",
                        help="write the plain requests' results (those --vanilla compares) to FILE as JSON")
    parser.add_argument("--readout", action="store_true",
                        help="compile the readout op in (HOTWIRE_READOUT=1) and check (f): the steering vector read "
                             "as a probe shows exactly what steering added, and (g): an entry gated on a condition that always "
                             "holds steers as without it, one that never holds does not")
    parser.add_argument("--vanilla-job", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    setup.add_arguments(parser)
    return parser


def _set_environment(args: argparse.Namespace, on_gpu: bool) -> None:
    """Before vLLM is imported: the runner, CPU-backend settings, and no vector store (the test vector is not
    kept)."""
    if args.runner:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    if not on_gpu:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
    if not args.model:
        os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ["HOTWIRE_STORE"] = "off"
    if args.readout:
        os.environ["HOTWIRE_READOUT"] = "1"
    # This process may touch CUDA before vLLM starts its engine; a forked engine could then not use the GPU.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vanilla_job:
        _vanilla_child(*args.vanilla_job)
        return 0
    import torch

    from hotwire_core.offline import HotwireError

    on_gpu = torch.cuda.is_available()
    bf16_only = not args.model and args.arch in CPU_BF16_ARCHS
    args.dtype = args.dtype or ("auto" if on_gpu else "bfloat16" if bf16_only else "float32")
    _set_environment(args, on_gpu)
    total = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hotwire-verify-") as tmp:
        workdir = Path(tmp)
        if args.model:
            model = args.model
        else:
            from hotwire_core.tiny_model import ModelShape, build_model

            model = str(build_model(workdir / "tiny-model", ModelShape(arch=args.arch)))
        try:
            header, checks, timings = run(args, model, workdir)
        except HotwireError as exc:
            print(f"verify: hotwire refused ({exc.status} {exc.code}): {exc}", file=sys.stderr)
            return 2
    print(format_report(header, checks, [*timings, ("total", time.monotonic() - total)]), flush=True)
    return exit_status(checks)


if __name__ == "__main__":
    sys.exit(main())
