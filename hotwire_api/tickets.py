"""Tickets: the proof that a steered request reaching this API server's engine client was admitted here.

The admission middleware (``hotwire_api.admission``) issues one per admitted request, for the spec (and readout)
it pinned.
The guard on the engine client (:meth:`TicketBook.check`, run by ``hotwire_core.vllm_glue.api_server`` on every
request vLLM adds) lets a steering spec into the engine only with a live ticket for exactly that spec, and
notes that the ticket was presented. So no route, body encoding or parser difference brings steering into the
engine past admission; and a response that delivers output although its ticket was never presented (vLLM served
the request by a path that dropped the spec, as beam search does) is refused instead of going out unsteered.

A ticket lives while its HTTP request does. One whose response delivered nothing yet (a background
``/v1/responses`` job, which generates after its response) is kept ``keep_s`` longer, at most ``max_kept`` of
them, oldest dropped first: memory stays bounded by the requests in flight plus that many.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hotwire_api.errors import HotwireError
from hotwire_core.contract import CAPTURE_KEY
from hotwire_core.error_codes import ErrorCode
from hotwire_core.readout_spec import READOUT_KEY
from hotwire_core.spec import SPEC_KEY, TICKET_KEY

__all__ = ["TICKETS", "Ticket", "TicketBook", "not_admitted"]


@dataclass
class Ticket:
    spec: str | None  # the pinned spec admission decided (None: a capture request, see hotwire_api.extraction)
    readout: str | None = None  # the pinned readout admission decided, with its tag (None: the request reads none)
    presented: bool = False  # the engine client added a request with it


def not_admitted(reason: str) -> HotwireError:
    return HotwireError(
        400, ErrorCode.NOT_ADMITTED,
        f"{reason}: hotwire steers only requests its admission decided, i.e. a spec in vllm_xargs.hotwire of a "
        "JSON body to POST /v1/chat/completions, /v1/completions, /v1/responses or /invocations", SPEC_KEY,
    )


class TicketBook:
    def __init__(self, keep_s: float = 600.0, max_kept: int = 10_000):
        self.keep_s, self.max_kept = keep_s, max_kept
        self._live: dict[str, Ticket] = {}
        self._kept: OrderedDict[str, tuple[Ticket, float]] = OrderedDict()  # closing order, with expiry

    def issue(self, spec: str | None, readout: str | None = None) -> str:
        """A ticket for a request with this pinned spec (None: a capture request of the extraction route, or one
        that only reads) and readout."""
        ticket = secrets.token_hex(16)
        self._live[ticket] = Ticket(spec, readout)
        return ticket

    def get(self, ticket: Any) -> Ticket | None:
        if not isinstance(ticket, str):
            return None
        found = self._live.get(ticket)
        if found is None and ticket in self._kept:
            found, expiry = self._kept[ticket]
            if expiry < time.monotonic():
                return None
        return found

    def close(self, ticket: str, keep: bool = False) -> None:
        """The HTTP request is over; ``keep``: work may still come for it (see the module docstring)."""
        found = self._live.pop(ticket, None)
        now = time.monotonic()
        if keep and found is not None:
            self._kept[ticket] = (found, now + self.keep_s)
        while self._kept and (len(self._kept) > self.max_kept or next(iter(self._kept.values()))[1] < now):
            self._kept.popitem(last=False)

    def check(self, extra_args: Mapping[str, Any] | None) -> None:
        """The engine client's guard: raises :class:`HotwireError` (400 ``not_admitted``) for a request that
        carries a spec, a readout or a ticket without a live ticket for exactly that spec and readout; marks the
        ticket presented."""
        if not extra_args or (SPEC_KEY not in extra_args and TICKET_KEY not in extra_args
                              and CAPTURE_KEY not in extra_args and READOUT_KEY not in extra_args):
            return
        ticket = self.get(extra_args.get(TICKET_KEY))
        if ticket is None and CAPTURE_KEY in extra_args:
            # Captures come only from POST /steer/vectors/extract, whose requests carry a ticket without a spec.
            raise HotwireError(400, ErrorCode.NOT_ADMITTED, f"{CAPTURE_KEY} is set by this server's vector extraction "
                               "only; use POST /steer/vectors/extract", CAPTURE_KEY)
        if ticket is None:
            raise not_admitted("this request carries steering that this server's admission did not decide")
        if extra_args.get(SPEC_KEY) != ticket.spec:
            raise not_admitted("this request's steering differs from what admission decided for it")
        if extra_args.get(READOUT_KEY) != ticket.readout:
            raise not_admitted("this request's readout differs from what admission decided for it")
        ticket.presented = True

    def __len__(self) -> int:
        return len(self._live) + len(self._kept)


TICKETS = TicketBook()
