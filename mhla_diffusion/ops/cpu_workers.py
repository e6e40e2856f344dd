"""Worker threads for the CPU operator's chunk loops, used by the library itself.

On a CPU, :func:`~mhla_diffusion.ops.attention.mhla_attention` processes its blocks a cache-sized chunk at a
time: copy a chunk's keys and values into a reused buffer, multiply, then the same for the queries (see
``_folded_blocks`` in :mod:`~mhla_diffusion.ops.folded_cpu`). Run as torch ops on torch's intra-op threads, every
such op is split over all
threads: at Wan's 21x30x50 grid one call makes 924 OpenMP parallel regions (against 6 for a plain einsum
linear attention), and the threads hand every chunk to each other. Thread 0 copies the first half of a
buffer and the product's thread 1 reads it, and the next copy overwrites lines that the other thread's
cache holds. That costs little while the threads' cores share a last-level cache. It costs a lot when they
do not, and on a virtual machine the host decides that, process by process and minute by minute. On this
project's 2-vCPU AMD EPYC machine the round trip of a cache line between the two vCPUs was either about 65
ns (one L3) or about 320 ns (two L3s). 21x30x50 fp32 on 2 threads, uncontended calls, 2026-12-04:

* one L3: MHLA about 362 ms against 292 ms for the plain linear attention. Chunk copies took 15 ms each
  pass and the products 101 + 127 ms.
* two L3s: MHLA 554-568 ms against 248-316 ms, with each chunk copy pass at 39-63 ms and the products at
  118-177 ms. A placement often lasted a whole process (one ran 40 s on two L3s throughout, the next two
  on one), so MHLA / linear came out either about 1.3 or 1.7-2.1 (issue 49).
* A busy neighbour process made it worse. Each of the 924 regions waits for both threads, so MHLA took
  2.4-3.8 s against 0.7-1.2 s for linear attention.

So with more than one torch thread the chunk loops run on :class:`ChunkWorkers`: one plain thread per torch
thread, each running torch ops single-threaded. Each worker takes whole chunks, copy and products together,
from a shared counter. A chunk's data then stays in one core's caches. No op waits for another thread, and
a worker that the system pauses just takes fewer chunks. The call then makes 24 parallel regions (the
mixing product, on torch's threads as before). Four processes interleaved old and new loops with linear
attention (load average 1.6-1.9), giving these per-process medians:

* one L3: old 396-444 ms, new 370-426 ms, linear 300-328 ms.
* two L3s: old 529-591 ms, new 411-459 ms, linear 302-312 ms.

``mhla bench --processes 9`` at the same load gave MHLA / linear of 1.21-1.78 before (median 1.52). After,
it gave 1.22-1.35 (median 1.25), and 1.25-1.44 (median 1.33) in a second run.

The pool starts on the first multi-threaded CPU call, with as many workers as ``torch.get_num_threads()``
in the calling thread, and starts again when that number changes or after a fork. Its threads are daemon
threads named ``mhla-cpu-worker-<i>``, and they sleep between calls. A worker sets its own thread count to 1
with ``torch.set_num_threads(1)``. That call also sets torch's default for threads that start later, so the
caller's count is then set again. Setting the environment variable ``MHLA_CPU_WORKERS=0`` turns the pool off:
the chunk loops then run as before, one multi-threaded op at a time, in the calling thread. They also run
there while a torch dispatch or function mode is active. Modes are per thread, so a worker's ops would
escape them. ``mhla bench`` measures peak memory under such a mode, so its peak is that of the loop in the
calling thread. Each extra worker adds one chunk's buffers, about 2.6 MB at 21x30x50.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
from typing import Callable, Sequence, TypeVar

import torch

__all__ = ["CPU_WORKERS_ENV", "ChunkWorkers", "chunk_workers", "run_chunks", "run_in_caller", "workers_disabled"]

#: Environment variable: ``0`` runs the CPU chunk loops in the calling thread on torch's intra-op threads.
CPU_WORKERS_ENV = "MHLA_CPU_WORKERS"

Chunk = TypeVar("Chunk")
Scratch = TypeVar("Scratch")


def workers_disabled() -> bool:
    """Whether ``MHLA_CPU_WORKERS=0`` (or ``false``, ``off``, ``no``) turns the worker threads off."""
    return os.environ.get(CPU_WORKERS_ENV, "").strip().lower() in ("0", "false", "off", "no")


class ChunkWorkers:
    """``threads`` daemon threads, each running torch ops on one thread, that share out the groups of a
    chunk loop (:meth:`run`). Build it through :func:`chunk_workers`. Build it in the thread whose
    ``torch.get_num_threads()`` it copies, because that count is set again in the building thread."""

    def __init__(self, threads: int) -> None:
        if threads < 2:
            raise ValueError(f"ChunkWorkers needs at least 2 threads, got {threads}")
        self.threads, self.pid = threads, os.getpid()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._running: set[threading.Event] = set()  # the stop flags of the runs in progress
        self._lock, self._closed = threading.Lock(), False
        ready = threading.Barrier(threads + 1)
        self._workers = [
            threading.Thread(target=self._serve, args=(ready,), name=f"mhla-cpu-worker-{i}", daemon=True)
            for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()
        ready.wait()  # every worker has set its own count to 1 ...
        torch.set_num_threads(threads)  # ... which also set torch's default for new threads: set it back

    def _serve(self, ready: threading.Barrier) -> None:
        torch.get_num_threads()  # ATen's lazy per-thread setup first, so that it cannot undo the next line later
        torch.set_num_threads(1)  # this thread's OpenMP and MKL threads: ops run on this thread only
        ready.wait()
        while True:
            item = self._tasks.get()
            if item is None:  # close()
                return
            task, done = item
            del item
            outcome = task()
            # Drop every tensor reference of the task before reporting: the caller may return and the
            # interpreter exit at once, and a tensor freed here after that aborts the process.
            del task
            done.put(outcome)
            del outcome, done

    def run(
        self,
        work: Callable[[Chunk, Scratch], None],
        groups: Sequence[Sequence[Chunk]],
        scratch: Callable[[], Scratch],
    ) -> None:
        """``work(chunk, buffers)`` for every chunk of every group, spread over the workers.

        A group runs whole, in order, on one worker (parts of one block that add into one summary). The
        workers take groups from a shared counter until none is left. Each worker makes its own
        ``buffers = scratch()`` before its first group. The caller's grad and inference modes apply (they
        are per thread in torch). Returns when every group is done. The first error raised in a worker
        stops the others after their current group and is raised here.
        """
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        counter, stop, done = itertools.count(), threading.Event(), queue.SimpleQueue()

        def task() -> BaseException | None:
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    buffers = None  # made on this worker's first group (a worker that comes late may get none)
                    while not stop.is_set() and (i := next(counter)) < len(groups):
                        if buffers is None:
                            buffers = scratch()
                        for chunk in groups[i]:
                            work(chunk, buffers)
            except BaseException as error:  # handed to the caller
                stop.set()
                return error
            return None

        tasks = min(self.threads, len(groups))
        with self._lock:  # a closed pool's threads are gone or going: its tasks would wait forever
            closed = self._closed
            if not closed:
                self._running.add(stop)
                for _ in range(tasks):
                    self._tasks.put((task, done))
        del task
        if closed:  # replaced by another thread's pool (another thread count) since the caller got this one
            run_in_caller(work, groups, scratch)
            return
        try:
            errors = [error for error in (done.get() for _ in range(tasks)) if error is not None]
        except BaseException:  # e.g. KeyboardInterrupt while waiting: let the workers stop early
            stop.set()
            raise
        finally:
            self._running.discard(stop)
        if errors:
            raise errors[0]
        if stop.is_set():
            raise RuntimeError("the CPU chunk workers were stopped (interpreter exit) before every chunk ran")

    def close(self, timeout: float | None = None, stop_runs: bool = False) -> None:
        """Let the worker threads end once they finish the tasks queued so far; with ``stop_runs``, the runs
        in progress stop after their current group instead (and raise). With a ``timeout`` (seconds), wait that
        long at most for the threads to end."""
        with self._lock:
            if stop_runs:
                for stop in self._running:
                    stop.set()
            if not self._closed:
                self._closed = True
                for _ in range(self.threads):
                    self._tasks.put(None)
        if timeout is not None:
            for worker in self._workers:
                worker.join(timeout)


_pool: ChunkWorkers | None = None
_pool_lock = threading.Lock()


def chunk_workers() -> ChunkWorkers | None:
    """The process's :class:`ChunkWorkers` for the calling thread's ``torch.get_num_threads()``. It is
    started on first use, and again after a fork or a change of that count. Returns ``None`` (run in the
    calling thread) for one thread, under ``MHLA_CPU_WORKERS=0``, inside a ``torch.compile`` trace, and
    while a torch dispatch or function mode is active in the calling thread (other than ``with
    torch.device(...)``). Modes are per thread, so the workers' ops would escape a profiler, a memory or
    traffic counter, or a fake-tensor mode."""
    global _pool
    threads = torch.get_num_threads()
    if threads < 2 or workers_disabled() or torch.compiler.is_compiling() or _modes_active():
        return None
    with _pool_lock:
        pool = _pool
        if pool is not None and pool.pid != os.getpid():  # a forked child: the parent's threads are not here
            pool = _pool = None
        if pool is None or pool.threads != threads:
            if pool is not None:
                pool.close()
            pool = _pool = ChunkWorkers(threads)
        return pool


def _modes_active() -> bool:
    """Whether the calling thread has a torch dispatch mode, or a function mode other than a device context."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if _get_current_dispatch_mode_stack():
        return True
    return any(not isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


@atexit.register
def _close_at_exit() -> None:
    """End the workers while the interpreter still runs: a worker thread that frees a tensor after the
    interpreter began to shut down aborts the process."""
    if _pool is not None and _pool.pid == os.getpid():
        _pool.close(timeout=10.0, stop_runs=True)


def run_chunks(
    work: Callable[[Chunk, Scratch], None],
    groups: Sequence[Sequence[Chunk]],
    scratch: Callable[[], Scratch],
    device: torch.device,
) -> None:
    """``work(chunk, buffers)`` for every chunk of ``groups``. On a CPU ``device``, with more than one group,
    this runs on :func:`chunk_workers` when it returns a pool (see :meth:`ChunkWorkers.run`). Otherwise it
    runs in order in the calling thread, with one ``buffers = scratch()``."""
    pool = chunk_workers() if len(groups) > 1 and device.type == "cpu" else None
    if pool is not None:
        pool.run(work, groups, scratch)
    else:
        run_in_caller(work, groups, scratch)


def run_in_caller(
    work: Callable[[Chunk, Scratch], None],
    groups: Sequence[Sequence[Chunk]],
    scratch: Callable[[], Scratch],
) -> None:
    """``work(chunk, buffers)`` for every chunk of ``groups`` in order, in the calling thread, with one
    ``buffers = scratch()``."""
    buffers = scratch()
    for group in groups:
        for chunk in group:
            work(chunk, buffers)
