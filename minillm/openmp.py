"""How long torch's idle OpenMP threads spin before they sleep (docs/rungs/12_realtime.md, "On a
busy machine"; notebook 12).

Torch's CPU wheels on Linux run their parallel ops on GNU OpenMP (libgomp). Between two parallel
ops a team's idle threads spin, waiting for the next one, for ``GOMP_SPINCOUNT`` iterations:
300,000 by default, milliseconds of a core, and longer in wall time when that core is shared. On
a quiet machine the spin is free (the core has nothing else to do) and catches the next op with
no wake-up. On a busy one -- a lab server, CI, other jobs on the same cores -- a spinning thread
burns the time slice that the thread it waits for needs, and every parallel op waits on a
thread the kernel has put behind the other jobs. Measured on this project's 2-core machine with
two busy loops beside it: the synchronous step 5-10x slower than with a short spin, and the
overlapped step (rung 12), whose forward and commit hop between two threads, up to 8x slower
than the synchronous one.

So minillm bounds the spin to ``BOUNDED_SPIN`` iterations (about 0.1 ms): long enough to catch
the next op inside a forward (microseconds apart), short enough that an idle thread gives its
core back while the host works between steps or while another job holds the core. libgomp reads
the variable once, when it is loaded: ``import minillm`` sets it before anything imports torch.
A user's own ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` wins; other OpenMP runtimes (macOS, Windows,
Intel's) ignore the variable. Peers (vLLM, Hugging Face in their own processes) run with their own
defaults: ``peer_environ`` takes the bound out of the environment they inherit.
"""
from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_VARIABLE = "GOMP_SPINCOUNT"
BOUNDED_SPIN = "10000"
# set beside the bound so that a peer's environment can tell minillm's bound from a user's
MARK = "MINILLM_BOUNDED_OPENMP_SPIN"


def bound_openmp_spin(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Bound libgomp's spin for this process and the ones it starts, unless the user chose a wait
    policy or torch (and with it libgomp) is loaded already. True if the bound was set."""
    if "torch" in sys.modules or SPIN_VARIABLE in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ[SPIN_VARIABLE] = BOUNDED_SPIN
    environ[MARK] = "1"
    return True


def peer_environ(environ: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """``environ`` without minillm's bound (a user's own ``GOMP_SPINCOUNT`` stays): a peer is
    measured with its own defaults."""
    if environ.pop(MARK, None):
        environ.pop(SPIN_VARIABLE, None)
    return environ
