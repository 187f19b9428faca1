"""BatchEncoder: the texts of concurrent coroutines tokenized together on a worker thread, each getting its own."""

import asyncio
import threading

from turnrl.chat.batch_encode import BatchEncoder


class Recording:
    """A template whose encode_many records each batch and the thread it ran on (the real one underneath)."""

    def __init__(self, template, fail: bool = False):
        self.template, self.fail = template, fail
        self.batches, self.threads = [], []

    def encode_many(self, texts):
        self.batches.append(list(texts))
        self.threads.append(threading.get_ident())
        if self.fail:
            raise RuntimeError("tokenizer broke")
        return self.template.encode_many(texts)


def test_concurrent_texts_go_in_one_batch_off_the_loop(smol_template):
    texts = [f"<|im_start|>user\nquestion {k} é 日本<|im_end|>\n" * (k + 1) for k in range(12)]
    recording = Recording(smol_template)
    encoder = BatchEncoder(recording)

    async def main():
        return await asyncio.gather(*(encoder.encode(text) for text in texts))
    got = asyncio.run(main())
    assert got == [smol_template.encode(text) for text in texts]
    assert recording.batches == [texts] and encoder.batches == 1
    assert recording.threads[0] != threading.get_ident()


def test_texts_asked_later_go_in_a_later_batch(smol_template):
    recording = Recording(smol_template)
    encoder = BatchEncoder(recording)

    async def main():
        first = await encoder.encode("one")
        second = await asyncio.gather(encoder.encode("two"), encoder.encode("three"))
        return first, second
    first, second = asyncio.run(main())
    assert first == smol_template.encode("one") and second == smol_template.encode_many(["two", "three"])
    assert recording.batches == [["one"], ["two", "three"]]


def test_an_error_reaches_every_caller_and_a_cancelled_one_is_skipped(smol_template):
    encoder = BatchEncoder(Recording(smol_template, fail=True))

    async def main():
        waiting = [asyncio.ensure_future(encoder.encode(t)) for t in ("a", "b", "c")]
        await asyncio.sleep(0)
        waiting[1].cancel()
        return await asyncio.gather(*waiting, return_exceptions=True)
    a, b, c = asyncio.run(main())
    assert isinstance(b, asyncio.CancelledError)
    for error in (a, c):
        assert isinstance(error, RuntimeError) and str(error) == "tokenizer broke"
