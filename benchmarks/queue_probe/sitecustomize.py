"""Loaded by every Python process of a server started with this folder leading its PYTHONPATH and
``HOTWIRE_QUEUE_PROBE_OUT`` set: in the engine core, vLLM's ``Scheduler.add_request`` and ``Scheduler.schedule`` are
timed, one JSON line per event in ``$HOTWIRE_QUEUE_PROBE_OUT/<pid>.jsonl``, so that ``analyze.py`` can tell why a
request waits in the scheduler's queue (``vllm:request_queue_time_seconds``): how many schedule calls passed it by,
and what each of those calls was short of. Patched when the scheduler module is first imported, before hotwire's
plugin wraps the same methods, so the times are vLLM's own."""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

_OUT = os.environ.get("HOTWIRE_QUEUE_PROBE_OUT")
_TARGET = "vllm.v1.core.sched.scheduler"


def _patch(module):
    cls = module.Scheduler
    log = open(os.path.join(_OUT, f"{os.getpid()}.jsonl"), "a", buffering=1)
    add, schedule = cls.add_request, cls.schedule

    def add_request(self, request):
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        log.write(json.dumps(["a", time.monotonic(), request.request_id, "hotwire" in extra,
                              len(request.prompt_token_ids or ())]) + "\n")
        return add(self, request)

    def timed_schedule(self, *args, **kwargs):
        waiting = len(self.waiting) + len(self.skipped_waiting)
        t0 = time.monotonic()
        out = schedule(self, *args, **kwargs)
        t1 = time.monotonic()
        new = [r.req_id for r in out.scheduled_new_reqs]
        log.write(json.dumps(["s", t0, t1 - t0, waiting, new, len(self.waiting) + len(self.skipped_waiting),
                              len(self.running), out.total_num_scheduled_tokens, self.max_num_scheduled_tokens,
                              self.max_num_running_reqs]) + "\n")
        return out

    cls.add_request, cls.schedule = add_request, timed_schedule


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _OUT:
    sys.meta_path.insert(0, _Hook())
