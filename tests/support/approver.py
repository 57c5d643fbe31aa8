"""An operator who approves from the event loop the waiting call runs on."""

from __future__ import annotations

import asyncio

from crewai_idempotent import Approvals, CacheBackend


async def approve_first_pending(backend: CacheBackend, poll_s: float) -> None:
    """Approve the first pending request as soon as one is stored.

    Run it on the same loop as a call that waits for approval: if the wait blocked the
    loop, this never runs and the call gives up with ApprovalRequired.
    """
    approvals = Approvals(backend)
    while True:
        pending = await asyncio.to_thread(approvals.list, "pending")
        if pending:
            await asyncio.to_thread(approvals.approve, pending[0].id, by="ops")
            return
        await asyncio.sleep(poll_s)
