"""Tokenize texts from many coroutines together, on a worker thread: the event loop goes on meanwhile.

The agent loop checks each finished trajectory's parity by tokenizing its full re-render: thousands of tokens
a trajectory, all of a batch's trajectories finishing within the same few steps. One at a time on the event loop
that held it 4.5 ms a trajectory here for a random-weight model's text (odd byte sequences are BPE's slow case),
while 255 others waited for their next turn. Here every text that asks within one pass of the loop goes to
`ChatTemplate.encode_many` in one call on the default executor.
"""

from __future__ import annotations

import asyncio
from typing import Any


class BatchEncoder:
    """`await encoder.encode(text)`: `template.encode(text)`, batched with the texts of other coroutines."""

    def __init__(self, template: Any):
        self.template = template
        self._pending: list[tuple[str, asyncio.Future]] = []
        self.batches = 0   # encode_many calls so far

    async def encode(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((text, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush, loop)
        return await future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        self.batches += 1
        job = loop.run_in_executor(None, self.template.encode_many, [text for text, _ in batch])

        def settle(done: asyncio.Future) -> None:
            error = done.exception() if not done.cancelled() else asyncio.CancelledError()
            for k, (_, future) in enumerate(batch):
                if future.done():          # its coroutine was cancelled meanwhile
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(done.result()[k])
        job.add_done_callback(settle)
