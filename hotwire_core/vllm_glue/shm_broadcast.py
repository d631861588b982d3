"""vLLM's shared-memory message queue (``vllm.distributed.device_communicators.shm_broadcast``) between the engine
core and its workers: a reader's idle wait bounded, as vLLM itself does from PR #45224 (merged 2026-06, after
0.25.1).

A reader that found no message in the ring and has been idle for a second waits on a ZeroMQ notification the writer
sends after each write; the notification is best effort (a PUB socket with a send high-water mark of 1 drops it
silently, and the SUB side conflates), and before that fix a worker waiting for its next command
(``dequeue(indefinite=True)``) polled with no timeout: a dropped notification parked it for good, with the command
in the ring, while the engine core waited for its answer. hotwire's CI saw exactly those two stacks in
``test_fleet.py`` on two busy cores (``benchmarks/results/2026-12-06_cpu_9c41571``). Bounded, the reader looks at the
ring again every ``RECHECK_MS`` whatever the notifications do. Releases that have the fix (its module constant
``SHM_READER_RECHECK_INTERVAL_MS``) are left alone."""

from __future__ import annotations

from typing import Any

from .patching import wrap

__all__ = ["RECHECK_MS", "patch_shm_broadcast"]

RECHECK_MS = 5000  # vLLM's SHM_READER_RECHECK_INTERVAL_MS


def patch_shm_broadcast(module: Any) -> None:
    waits = getattr(module.MessageQueue, "ReadTimeoutWithWarnings", None)
    if hasattr(module, "SHM_READER_RECHECK_INTERVAL_MS") or waits is None or "timeout_ms" not in vars(waits):
        return  # fixed, or built otherwise than the releases read for this

    def make_timeout_ms(original):
        def timeout_ms(self):
            wait = original(self)  # raises TimeoutError past a deadline, as before
            return RECHECK_MS if wait is None else min(wait, RECHECK_MS)

        return timeout_ms

    wrap(waits, "timeout_ms", make_timeout_ms)
