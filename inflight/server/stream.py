"""A request's outputs on their way from the engine thread to the asyncio handler.

The engine thread puts items (`ADMITTED`, then `Delta`s, or an exception that ends the
request) with `call_soon_threadsafe`; the handler reads them on its event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import NamedTuple

from inflight.request import FinishReason, TokenLogprobs


class Delta(NamedTuple):
    """What one step produced for one request, as plain data for the event loop."""

    text: str
    num_new_tokens: int
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # of the step's token, if the request asks
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first token, if the request asks
    error_from_request: bool = False  # the request's own input failed it (a 400, not a 500)

    @property
    def error_status(self) -> int:
        return 400 if self.error_from_request else 500

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None



ADMITTED = object()  # first item of a stream once the engine has queued the request


class RequestStream:
    """The outputs of one request, readable on the event loop that created it."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self.finished = False  # set on the event loop when the last item has been read
        self.in_engine = False  # set by the engine thread once the engine has the request

    def put(self, item: object) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def wait_admitted(self) -> None:
        """Returns once the engine has queued the request; raises the reason it refused it."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yields the request's outputs until it finishes; raises if the engine ended it."""
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if not isinstance(item, Delta):  # the admission mark, if nobody waited for it
                continue
            self.finished = item.finished
            yield item
