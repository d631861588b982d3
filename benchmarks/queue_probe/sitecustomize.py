"""Loaded by every Python process of a server started with this folder leading its PYTHONPATH and
``HOTWIRE_QUEUE_PROBE_OUT`` set: in the engine core, vLLM's ``Scheduler.add_request`` and ``Scheduler.schedule``
and the engine core's handling of each client message (``EngineCoreProc._handle_client_request``: an added request with
its admission, an abort, a utility call) are timed, one JSON line per event in
``$HOTWIRE_QUEUE_PROBE_OUT/<pid>.jsonl``, so that ``analyze.py`` can tell why a request waits in the scheduler's
queue (``vllm:request_queue_time_seconds``, from ``Scheduler.add_request`` to the start of the schedule call that
schedules it): how many schedule calls passed it by, and what the engine core did in between. Patched when each
module is first imported, before hotwire's plugin wraps the same methods: the scheduler's times are vLLM's own, the
handling includes hotwire's admission."""

import collections
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time

_OUT = os.environ.get("HOTWIRE_QUEUE_PROBE_OUT")
_log = None


class _Log:
    """Events queued by the engine core's loop and written by a thread of their own every 0.5 s: a write per event
    in the loop would add its own time to the queue times measured (a killed process loses its last 0.5 s)."""

    def __init__(self, path):
        self._events = collections.deque()
        self._file = open(path, "a")
        threading.Thread(target=self._write_every, name="queue-probe", daemon=True).start()

    def note(self, event):
        self._events.append(event)

    def _write_every(self):
        while True:
            time.sleep(0.5)
            lines = []
            while self._events:
                lines.append(json.dumps(self._events.popleft()) + "\n")
            if lines:
                self._file.write("".join(lines))
                self._file.flush()


def _open():
    global _log
    if _log is None:
        _log = _Log(os.path.join(_OUT, f"{os.getpid()}.jsonl"))
        # which server this engine core is (analyze.py names each file by it)
        _log.note(["env", os.getppid(), os.environ.get("VLLM_PLUGINS"), os.environ.get("HOTWIRE_READOUT")])
    return _log


def _patch_scheduler(module):
    cls = module.Scheduler
    log = _open()
    add, schedule = cls.add_request, cls.schedule

    def add_request(self, request):
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        log.note(["a", time.monotonic(), request.request_id, "hotwire" in extra, len(request.prompt_token_ids or ())])
        return add(self, request)

    def timed_schedule(self, *args, **kwargs):
        waiting = len(self.waiting) + len(self.skipped_waiting)
        t0 = time.monotonic()
        out = schedule(self, *args, **kwargs)
        t1 = time.monotonic()
        new = [r.req_id for r in out.scheduled_new_reqs]
        log.note(["s", t0, t1 - t0, waiting, new, len(self.waiting) + len(self.skipped_waiting), len(self.running),
                  out.total_num_scheduled_tokens, self.max_num_scheduled_tokens, self.max_num_running_reqs])
        return out

    cls.add_request, cls.schedule = add_request, timed_schedule


def _what(request_type, request):
    """An added request's id and whether it steers; an abort's count; a utility call's method (and RPC)."""
    name = getattr(request_type, "name", str(request_type))
    if name == "ADD":
        req = request[0]
        extra = getattr(req.sampling_params, "extra_args", None) or {}
        return [name, req.request_id, "hotwire" in extra]
    if name == "UTILITY":
        _, _, method, args = request
        rpc = args[0] if method == "collective_rpc" and args and isinstance(args[0], str) else None
        return [name, method, rpc]
    return [name, None, None]


class _Profiles:
    """With ``HOTWIRE_QUEUE_PROBE_CPROFILE`` set: cProfile of the handling of added requests, one profile for steered
    and one for plain ones, written every 200 requests to ``<pid>.<steered|plain>.prof`` (``pstats`` reads them)."""

    def __init__(self):
        import cProfile

        self._made = cProfile.Profile
        self._by_kind = {}
        self._count = 0

    def run(self, steered, call):
        kind = "steered" if steered else "plain"
        profile = self._by_kind.setdefault(kind, self._made())
        profile.enable()
        try:
            return call()
        finally:
            profile.disable()
            self._count += 1
            if self._count % 200 == 0:
                for name, p in self._by_kind.items():
                    p.dump_stats(os.path.join(_OUT, f"{os.getpid()}.{name}.prof"))


def _patch_engine_core(module):
    cls = module.EngineCoreProc  # the busy loop's class
    handle = cls._handle_client_request
    profiles = _Profiles() if os.environ.get("HOTWIRE_QUEUE_PROBE_CPROFILE") else None

    def _handle_client_request(self, request_type, request):
        t0, cpu0 = time.monotonic(), time.thread_time()
        what = _what(request_type, request)
        try:
            if profiles is not None and what[0] == "ADD":
                return profiles.run(what[2], lambda: handle(self, request_type, request))
            return handle(self, request_type, request)
        finally:
            # the loop thread's own CPU time beside the wall time: the rest it waited (the GIL, the OS)
            _open().note(["h", t0, time.monotonic() - t0, *what, time.thread_time() - cpu0])

    cls._handle_client_request = _handle_client_request


_TARGETS = {"vllm.v1.core.sched.scheduler": _patch_scheduler, "vllm.v1.engine.core": _patch_engine_core}


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _TARGETS.pop(name, None)
        if patch is None:
            return None
        if not _TARGETS:
            sys.meta_path.remove(self)
        # straight from the path: asking every finder again would let another patching finder (hotwire's own)
        # wrap the same loader twice
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _OUT:
    sys.meta_path.insert(0, _Hook())
