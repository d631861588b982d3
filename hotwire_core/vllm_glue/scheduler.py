"""The scheduler (``vllm.v1.core.sched.scheduler.Scheduler``): requests deferred for rows, bank writes riding on
the ``SchedulerOutput``, pins released when a request is freed, preemption and resumption, streaming sessions."""

from __future__ import annotations

import functools
from typing import Any

from .. import contract
from . import compat
from .patching import wrap

__all__ = ["patch_scheduler"]


def patch_scheduler(module: Any) -> None:
    cls = module.Scheduler
    unpaused = module.PauseState.UNPAUSED

    def make_schedule(original):
        def schedule(self, *args, **kwargs):
            controller = getattr(self, "hotwire", None)
            if controller is not None and controller.changes.pending:
                controller.changes.pump()  # registrations whose store write is done take effect, and are answered
            # (A change waiting for the store also steps a paused engine: requests held for rows wait for the resume.)
            if controller is not None and controller.deferred and self.pause_state == unpaused:
                for request in controller.admit_deferred():
                    self.add_request(request)
            output = original(self, *args, **kwargs)
            # Checked after vLLM's schedule: resuming a preempted request inside it may reload rows.
            if controller is not None and controller.step_payload_pending:
                writes = controller.take_writes()
                if writes:
                    setattr(output, contract.WRITES_ATTR, writes)
                rebinds = controller.take_rebinds()
                if rebinds:
                    setattr(output, contract.REBINDS_ATTR, rebinds)
            return output

        return schedule

    def make_free(original):
        def _free_request(self, request, *args, **kwargs):
            controller = getattr(self, "hotwire", None)
            if controller is not None:
                controller.release(request.request_id)
            return original(self, request, *args, **kwargs)

        return _free_request

    def make_has_requests(original):
        def has_requests(self):
            # Deferred requests are work: the engine must keep stepping to admit them. Like vLLM's own waiting
            # requests, not while it is paused (a pause completes once nothing counts as work).
            controller = getattr(self, "hotwire", None)
            deferred = controller is not None and controller.deferred and self.pause_state == unpaused
            # So are registrations waiting for their store write (even paused: their callers wait for an answer).
            return original(self) or bool(deferred) or (controller is not None and controller.changes.pending)

        return has_requests

    as_requests = compat.finish_requests_returns_requests(cls)

    def make_finish(original):
        def finish_requests(self, request_ids, finished_status):
            controller = getattr(self, "hotwire", None)
            dropped = controller.drop_deferred(request_ids) if controller is not None else []
            finished = original(self, request_ids, finished_status)
            if request_ids is None:  # pause(abort), shutdown: vLLM sends an abort output for each one it returns
                finished = [*finished, *(dropped if as_requests else ((r.request_id, r.client_index) for r in dropped))]
            return finished

        return finish_requests

    def make_update_session(original):
        def _update_request_as_session(self, session, update):
            result = original(self, session, update)
            controller = getattr(self, "hotwire", None)
            if controller is not None:
                controller.keep_binding(session)
            return result

        return _update_request_as_session

    def make_preempt(original):
        def _preempt_request(self, request, *args, **kwargs):
            result = original(self, request, *args, **kwargs)
            controller = getattr(self, "hotwire", None)
            if controller is not None:
                controller.suspend(request.request_id)
            return result

        return _preempt_request

    # A preempted request waits in the queue until it can pin its rows again: the scheduler skips it (as it skips
    # one waiting for remote KV) and asks again every step. Up to 0.30 it asks only about requests whose status
    # counts as blocked, so PREEMPTED is made to count; from 0.31 it asks about every waiting request.
    preempted = module.RequestStatus.PREEMPTED
    blocked_only = compat.promotes_blocked_requests_only(cls)
    promote_name = "_try_promote_blocked_waiting_request" if blocked_only else "_handle_blocked_waiting_request"
    is_blocked = cls.__dict__["_is_blocked_waiting_status"].__func__
    if blocked_only and not getattr(is_blocked, "_hotwire", False):
        def _is_blocked_waiting_status(status):
            return status == preempted or is_blocked(status)

        _is_blocked_waiting_status._hotwire = True
        cls._is_blocked_waiting_status = staticmethod(functools.wraps(is_blocked)(_is_blocked_waiting_status))

    def make_promote(original):
        def promote(self, request):
            if request.status != preempted:
                return original(self, request)
            controller = getattr(self, "hotwire", None)
            return controller is None or controller.resume(request)

        return promote

    wrap(cls, "schedule", make_schedule)
    wrap(cls, "_free_request", make_free)
    wrap(cls, "_preempt_request", make_preempt)
    wrap(cls, promote_name, make_promote)
    wrap(cls, "has_requests", make_has_requests)
    wrap(cls, "finish_requests", make_finish)
    wrap(cls, "_update_request_as_session", make_update_session)


