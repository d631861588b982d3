"""The report of ``python -m hotwire_core.verify``: its header (model, device, versions), one line per check, the
timings, the verdict and the exit status."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hotwire_core.verify.checks import Check

Header = list[tuple[str, str]]  # report fields: (name, value)
Timings = list[tuple[str, float]]  # (what, seconds)


def format_report(header: Header, checks: Sequence[Check], timings: Timings) -> str:
    """The report block: header fields, one line per check, timings and the verdict."""
    rule = "=" * 78
    lines = [rule, "hotwire verify", rule]
    lines += [f"{key:<11}{value}" for key, value in header]
    lines.append("-" * 78)
    width = max((len(c.name) for c in checks), default=0)
    lines += [f"{'PASS' if c.passed else 'FAIL'}  {c.name:<{width}}  {c.detail}" for c in checks]
    lines.append("-" * 78)
    lines.append("timings    " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings))
    failed = [c.name for c in checks if not c.passed]
    verdict = f"PASS ({len(checks)}/{len(checks)} checks)" if not failed else f"FAIL ({', '.join(failed)})"
    lines += [f"{'result':<11}{verdict}", rule]
    return "\n".join(lines)


def exit_status(checks: Sequence[Check]) -> int:
    return 0 if checks and all(c.passed for c in checks) else 1


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"GPU: {torch.cuda.get_device_name(0)}"
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {name} ({os.cpu_count()} cores)"


def runner_name(llm: Any, forced: str | None) -> str:
    from hotwire_core.vllm_glue.compat import uses_v2_model_runner

    used = "v2" if uses_v2_model_runner(llm.llm_engine.vllm_config) else "v1"
    return f"{used} ({'--runner ' + forced if forced else 'vLLM default'})"


def report_header(llm: Any, model: str, runner: str | None, entry: dict, vector_norm: float, setup: str) -> Header:
    import vllm

    import hotwire_core

    config = llm.llm_engine.model_config
    n_layers = config.get_total_num_hidden_layers()  # get_num_layers counts one pipeline stage's
    arch = ",".join(config.architectures or ())
    tp = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    return [
        ("model", f"{model} ({arch}, hidden {config.get_hidden_size()}, {n_layers} layers, tensor parallel {tp})"),
        ("dtype", str(config.dtype).removeprefix("torch.")),
        ("device", device_name()),
        ("vLLM", f"{vllm.__version__}, hotwire {hotwire_core.__version__}, runner {runner_name(llm, runner)}"),
        ("setup", setup),
        ("steering", f"{json.dumps(entry)}, random normal vector (norm {vector_norm:.1f})"),
    ]
