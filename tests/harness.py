"""A pool of gloo worker processes per world size, reused across tests.

Starting processes and importing torch costs seconds; each world size gets one pool of
workers that stays up for the whole pytest session and runs one test function at a time
on every rank. A failure on any rank is re-raised with that rank's traceback. A test that
hangs (a collective mismatch) is stopped by the timeout and its pool is replaced.

``FSDP8_TEST_BACKEND=nccl`` runs the same tests with one GPU per rank (on the GPU machine);
world sizes larger than the number of GPUs are skipped there.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List

BACKEND = os.environ.get("FSDP8_TEST_BACKEND", "gloo")
# Seconds a test may take on its ranks before it counts as hung (a test may ask for more or less).
TIMEOUT_S = float(os.environ.get("FSDP8_TEST_TIMEOUT", "240"))


class RankFailure(AssertionError):
    pass


def _fresh_state() -> None:
    """Each task starts as in a fresh process: with no meshes kept from the tasks before it (fsdp8
    reuses a layout's mesh for the life of the default process group, [Note: one mesh per
    layout], which a pool keeps from test to test; compiled code and DTensor caches keyed on a
    reused mesh would carry one test's state into the next) and no compiled code (Dynamo marks a
    dimension dynamic when code it compiled once meets another size, so an earlier test's shapes
    would make this test's graphs symbolic)."""
    from fsdp8.distributed import mesh

    mesh._meshes.clear()
    if "torch._dynamo" in sys.modules:  # only where a task compiled: importing Dynamo takes seconds
        sys.modules["torch._dynamo"].reset()


def _pickled(value):
    """(True, ``value`` pickled) to travel back to pytest's process, or (False, why it cannot): a
    queue pickles in a thread of its own, where a failure is printed and the result lost (the test
    then waited for its timeout). Pickled here, once; the queue sends the bytes as they are."""
    try:
        return True, pickle.dumps(value)
    except Exception as e:  # noqa: BLE001 -- any pickling failure is the task's failure
        return False, f"the task returned a value that cannot be sent back ({type(e).__name__}: {e}): {value!r:.500}"


def _worker(rank: int, world: int, port: int, tasks, results, stacks_path: str) -> None:
    # SIGUSR1 writes every thread's Python stack here: what a hung rank waits on (see RankPool.run).
    stacks = open(stacks_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    # The pool's store, already listening in pytest's process (see RankPool.__init__).
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=90))

    torch.set_num_threads(1)
    kwargs = {}
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=90), **kwargs)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # pytest was killed: daemon workers outlive a SIGKILLed parent
                os._exit(1)
            continue
        if task is None:
            break
        module, name, args = task
        try:
            _fresh_state()
            fn = getattr(importlib.import_module(module), name)
            value = fn(*args)
        except BaseException:  # report everything, keep serving
            results.put((rank, False, traceback.format_exc(), _threads()))
        else:
            results.put((rank, *_pickled(value), _threads()))
    dist.destroy_process_group()


def _threads() -> int:
    """This process's thread count (0 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


# [Note: recycling pools]
# Every gloo process group a test makes (each device mesh dimension, each new_group) keeps
# its own polling threads for the life of the process, and torch's DTensor caches forbid
# destroying groups behind meshes that compare equal to later ones. After a few hundred tests
# a pool's idle workers held ~540 threads each and four of them took most of a core from
# whatever test ran next. So a pool whose workers have grown past MAX_THREADS is closed after
# its task, and the next test of that world size starts a fresh one (3-7 s).
MAX_THREADS = int(os.environ.get("FSDP8_TEST_MAX_THREADS", "100"))


class RankPool:
    def __init__(self, world: int):
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        # The rendezvous store listens here, on a port the OS picked as it bound it: a port
        # merely found free could be taken by another pool before rank 0 binds it (pytest-xdist
        # runs several sessions at once), and that rank would die at start-up.
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        port = self.store.port
        self.stacks = [tempfile.NamedTemporaryFile(prefix=f"fsdp8-rank{r}-stacks-", delete=False).name
                       for r in range(world)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results, self.stacks[r]),
                        daemon=True)
            for r in range(world)
        ]
        self.threads = 0  # the most any worker has had after a task
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args, timeout: float = TIMEOUT_S) -> List[Any]:
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args))
        out: Dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world:
            try:
                rank, ok, value, threads = self.results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died (NCCL's watchdog aborts a process whose collective timed out)
                # never reports: fail now with its exit code instead of waiting out the timeout.
                dead = [r for r, p in enumerate(self.procs) if r not in out and not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    stacks = self._dump_stacks()
                    self.close()
                    what = (f"rank(s) {', '.join(map(str, dead))} died (exit codes "
                            f"{', '.join(str(self.exitcodes[r]) for r in dead)})" if dead
                            else f"timed out after {timeout}s (hang?)")
                    raise RankFailure(f"{fn.__name__} {what} at world size {self.world}; ranks that had not "
                                      f"answered: {sorted(set(range(self.world)) - set(out))}\n{stacks}")
                continue
            if not ok:
                # Other ranks may now wait in a collective forever: replace the whole pool.
                self.close()
                raise RankFailure(f"{fn.__name__} failed on rank {rank} of {self.world}:\n{value}")
            out[rank] = pickle.loads(value)
            self.threads = max(self.threads, threads)
        return [out[r] for r in range(self.world)]

    def _dump_stacks(self) -> str:
        """Every live rank's Python stacks (faulthandler, on SIGUSR1): where each one waits."""
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)
        dumps = []
        for rank, path in enumerate(self.stacks):
            with open(path) as f:
                text = f.read().strip()
            if text:
                dumps.append(f"--- rank {rank} stacks ---\n{text}")
        return "\n".join(dumps)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        self.exitcodes = [p.exitcode for p in self.procs]
        self.procs = []
        self.store = None
        for path in self.stacks:
            if os.path.exists(path):
                os.unlink(path)

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)


_POOLS: Dict[int, RankPool] = {}


def run_on_ranks(world: int, fn: Callable, *args, timeout: float = TIMEOUT_S) -> List[Any]:
    """Run ``fn(*args)`` on every rank of a gloo group of ``world`` processes; return per-rank results.

    ``fn`` must be a module-level function of an importable module. ``FSDP8_TEST_WORLDS=1,4``
    runs only those world sizes (a GPU run that already covered the others skips them)."""
    worlds = os.environ.get("FSDP8_TEST_WORLDS", "").strip()
    if worlds and world not in {int(w) for w in worlds.split(",") if w.strip()}:
        import pytest

        pytest.skip(f"world size {world} not in FSDP8_TEST_WORLDS={worlds}")
    if BACKEND == "nccl":
        import pytest
        import torch

        if world > torch.cuda.device_count():
            pytest.skip(f"world size {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
    pool = _POOLS.get(world)
    if pool is None or not pool.alive:
        pool = _POOLS[world] = RankPool(world)
    try:
        return pool.run(fn, *args, timeout=timeout)
    finally:
        if not pool.alive or pool.threads > MAX_THREADS:  # see [Note: recycling pools]
            pool.close()
            _POOLS.pop(world, None)


def retire_pool(world: int) -> None:
    """Close the pool of ``world`` processes so the next run starts a fresh one (after a task
    that left a collective pending on purpose and caught its error)."""
    pool = _POOLS.pop(world, None)
    if pool is not None:
        pool.close()


@atexit.register
def _close_all() -> None:
    for pool in _POOLS.values():
        pool.close()
