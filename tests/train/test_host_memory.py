"""With freed memory kept, allocating the same large buffers again faults no pages in; with glibc's defaults
every large allocation is faulted in anew."""

import subprocess
import sys

import pytest

from turnrl.train.host_memory import retain_for_training

PROBE = """
import resource, sys, torch
from turnrl.train.host_memory import retain_freed_memory
took = retain_freed_memory() if sys.argv[1] == "retain" else None
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [torch.empty(64 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]   # 3 x 64 MiB
    del buffers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, sorted(faults[1:])[2])   # the median later round (a round may grow the heap once)
"""


def _faults(mode):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    took, faults = out.split()
    return took, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_memory_is_reused_without_page_faults():
    took, kept = _faults("retain")
    _, default = _faults("default")
    assert took == "True"
    assert default > 3 * (64 << 20) // 4096 * 0.9   # every page of a round, faulted in again
    assert kept < 1000                              # the heap's pages, reused


def test_only_cpu_training_with_the_switch_on_changes_malloc():
    assert retain_for_training("cuda", True) is False
    assert retain_for_training("cpu", False) is False
