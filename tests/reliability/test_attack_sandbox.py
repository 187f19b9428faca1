"""Every sandbox call starts in a fresh, empty working directory (issue 17 item 4): nothing one call writes
under /work reaches a later call on the same worker, and one call filling /work does not make later calls fail."""

import pytest

from turnrl.env.sandbox import SandboxPool, SandboxSettings


@pytest.fixture(scope="module")
def one_worker():
    pool = SandboxPool(SandboxSettings(timeout_s=5.0, workers=1, work_mb=8, file_mb=16))
    if not pool.isolate:
        pytest.skip("the sandbox is not isolated on this machine")
    yield pool
    pool.close()


def test_nothing_written_under_work_reaches_the_next_call(one_worker):
    first = one_worker.run("open('/work/leak.txt', 'w').write('from call 1')\n"
                           "open('mine.txt', 'w').write('x')\nprint('ok')")
    assert "ok" in first.output, first
    second = one_worker.run("import os\nprint(sorted(os.listdir('/work')), sorted(os.listdir('.')))")
    listed, own = second.output.strip().split("] [")
    assert listed.count("'") == 2 and own == "]", second       # its own, empty directory, and nothing else
    assert "leak.txt" not in second.output and "mine.txt" not in second.output, second


def test_a_call_filling_work_does_not_break_the_next_one(one_worker):
    fill = one_worker.run("f = open('/work/fill', 'wb')\ntry:\n    f.write(b'0' * (7 << 20))\nexcept OSError as e:\n"
                          "    print(e)\nprint('filled')")
    assert "filled" in fill.output, fill
    after = one_worker.run("open('out.txt', 'wb').write(b'1' * (2 << 20))\nprint('wrote')")
    assert "wrote" in after.output and "No space" not in after.output, after
