"""Worker processes for the data steps' per-file and per-shard work (`bert clean`, `bert
instances`).

forkserver, not fork. A step starts its pool from a process that already runs other threads
(pyarrow's jemalloc background thread, MLflow's, a KFP executor's), and `fork` copies into each
child whatever lock one of those threads held at that instant, which nothing in the child will
ever release: seen here as a kfp.local run whose `bert instances` hung for good, a worker asleep
on a futex from its first instruction and the pool waiting for it. The forkserver is a fresh,
single-threaded process, started once per step, that forks the workers; it imports the module
doing the work first (`preload`), so a worker still starts in milliseconds. (Python 3.14 made
forkserver the default on Linux for the same reason.) `spawn` where there is no forkserver.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.pool import Pool

START_METHOD = "forkserver" if "forkserver" in get_all_start_methods() else "spawn"


def pool(processes: int, preload: str, initializer: Callable[[], None] | None = None) -> Pool:
    """A process pool of `processes` workers, forked by a forkserver that imported `preload`
    (the module whose functions the workers run)."""
    ctx = get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload([preload])
    return ctx.Pool(processes, initializer=initializer)
