"""runtime/heap.py: memory freed by engines goes back to the OS before the next engine is built
(glibc keeps freed blocks of a few MB in its heap; notebook 06's kernel reached 9.3 GB and was
OOM-killed beside the test workers)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from minillm import engines
from minillm.runtime import heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="no glibc malloc_trim here")

# In a fresh process with the runner's malloc settings (core/runner.py's keep_freed_memory: blocks
# under 32 MiB from the heap, freed memory kept up to 1 GiB, so steps reuse their pages): blocks
# the size of oneDNN's packed SmolLM2 weights (3.5 MB) allocated and freed stay resident, as a
# freed engine's did, until the heap is trimmed.
PROBE = """
import gc, torch
from minillm.core.runner import keep_freed_memory
from minillm.runtime import heap
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20
assert keep_freed_memory()
base = rss_mb()
blocks = [torch.ones(1536 * 576) for _ in range(100)]
del blocks
gc.collect()
held = rss_mb()
heap.trim()
print(base, held, rss_mb())
"""


def test_trim_gives_freed_heap_blocks_back():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    base, held, trimmed = map(int, out)
    assert held - base >= 300, (base, held)            # 100 blocks of 3.5 MB stayed after free
    assert held - trimmed >= 300, (held, trimmed)      # and the trim gave them back


def test_an_engine_is_built_after_the_heap_is_trimmed(tiny, monkeypatch):
    calls = []
    monkeypatch.setattr(engines, "trim", lambda: calls.append(1) or True)
    engines.create_engine("paged", tiny)
    assert calls == [1]
