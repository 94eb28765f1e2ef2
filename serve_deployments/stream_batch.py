"""A token stream joined into fewer messages for the hops it travels (replica -> ingress -> proxy -> client).

vLLM's server writes one SSE event per token straight to its socket. Here every event is a message of a
Ray streaming call, twice (replica -> ingress, ingress -> proxy): on a 2-core machine those messages, not
the engine, set the pace. `batched` sends the first event at once (time to first token is untouched) and
then at most one message per `interval_s`, holding every event that arrived meanwhile, in order; joined
SSE events are still valid SSE. Ray Serve LLM does the same (its `stream_batching_interval_ms`, 50 ms).
The end of the stream is not held: a request is done when its last event arrives, and under a closed loop of
clients (a fixed number of requests in flight) every millisecond held there is a request not sent (on the
H200, with 32-token answers, waiting out the interval added ~25 ms to a 130 ms request).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

_END = object()


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


async def batched(source: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """`source`'s strings, the first alone and then joined per `interval_s` (0: one message per string).
    An error of `source` is raised after the strings it produced before it; closing this generator (the
    client left) cancels the read of `source`, which aborts the request in the engine."""
    if interval_s <= 0:
        async for item in source:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    ended = asyncio.Event()

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
        except Exception as e:
            queue.put_nowait(_Raised(e))
        finally:
            queue.put_nowait(_END)
            ended.set()

    loop = asyncio.get_running_loop()
    reader = asyncio.ensure_future(pump())
    last = None  # when the previous message left
    try:
        while True:
            items = [await queue.get()]
            if last is not None and (wait := last + interval_s - loop.time()) > 0 and not ended.is_set():
                try:  # until the interval is over, or the stream ends: its last events go at once
                    await asyncio.wait_for(ended.wait(), wait)
                except asyncio.TimeoutError:
                    pass
            while not queue.empty():
                items.append(queue.get_nowait())
            text = "".join(x for x in items if isinstance(x, str))
            if text:
                yield text
                last = loop.time()
            for x in items:
                if isinstance(x, _Raised):
                    raise x.error
            if items[-1] is _END:
                return
    finally:
        if not reader.done():
            reader.cancel()
            try:
                await reader
            except asyncio.CancelledError:
                pass
