"""The CPU operator's chunk loops on worker threads (mhla_diffusion.ops.cpu_workers): same results as the
reference, every chunk on a worker, parts of a block in order on one worker, errors and modes carried over."""

from __future__ import annotations

import threading

import pytest
import torch

from helpers.attention import make_inputs
from mhla_diffusion import mhla_attention, mhla_attention_reference, num_blocks
from mhla_diffusion.ops import cpu_workers, folded_cpu


@pytest.fixture
def threads():
    """Run the test with the given torch thread count; the count before is restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def reader_threads(monkeypatch):
    """The names of the threads that regrouped chunks (both chunk kinds), in call order."""
    names: list[str] = []
    for cls in (folded_cpu._EvenChunks, folded_cpu._GatheredChunks):
        read = cls.read
        monkeypatch.setattr(
            cls, "read", lambda *a, read=read, **kw: names.append(threading.current_thread().name) or read(*a, **kw)
        )
    return names


GRIDS = [((4, 6), (2, 3)), ((2, 4, 6), (2, 2, 3)), ((5, 7), (2, 3)), ((2, 5), (3, 2))]


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("chunk_bytes", [200, 600, 1 << 30])
@pytest.mark.parametrize("grid,layout", GRIDS)
@pytest.mark.parametrize("feature_eps", [None, 1e-3])
def test_workers_match_reference(monkeypatch, threads, reader_threads, count, chunk_bytes, grid, layout, feature_eps):
    """With several torch threads every chunk runs on a worker; results equal the O(N^2) reference. Chunks of
    part of a block (200 bytes), one block (600) and everything (1 GiB, a single group: the calling thread)."""
    threads(count)
    monkeypatch.setattr(folded_cpu, "CPU_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(folded_cpu, "CPU_MIN_PART_TOKENS", 1)
    monkeypatch.delenv(cpu_workers.CPU_WORKERS_ENV, raising=False)
    q, k, v, _, _ = make_inputs(grid, seed=4)
    if feature_eps is not None:
        q, k = q - 0.5, k - 0.5
    m = num_blocks(layout)
    mixing = torch.rand((3, m, m), generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.1
    fast = mhla_attention(q, k, v, grid, layout, mixing, feature_eps=feature_eps)
    if feature_eps is not None:
        q, k = q.relu() + feature_eps, k.relu() + feature_eps
    torch.testing.assert_close(fast, mhla_attention_reference(q, k, v, grid, layout, mixing), rtol=1e-10, atol=1e-10)
    assert reader_threads, "the folded path did not run"
    caller = threading.current_thread().name
    if chunk_bytes == 1 << 30 and grid in ((4, 6), (2, 4, 6)):  # one chunk of everything: no worker needed
        assert set(reader_threads) == {caller}
    else:
        assert all(name.startswith("mhla-cpu-worker-") for name in reader_threads), set(reader_threads)
    assert torch.get_num_threads() == count  # the workers' own count of 1 did not leak into the caller


def test_one_thread_or_switched_off_runs_in_the_caller(monkeypatch, threads, reader_threads):
    """One torch thread, or MHLA_CPU_WORKERS=0, keeps the chunk loops in the calling thread: same result."""
    monkeypatch.setattr(folded_cpu, "CPU_CHUNK_BYTES", 600)
    grid, layout = (4, 6), (2, 3)
    q, k, v, _, _ = make_inputs(grid, seed=6)
    mixing = torch.rand((6, 6), generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.1
    reference = mhla_attention_reference(q, k, v, grid, layout, mixing)
    threads(1)
    torch.testing.assert_close(mhla_attention(q, k, v, grid, layout, mixing), reference, rtol=1e-10, atol=1e-10)
    threads(2)
    monkeypatch.setenv(cpu_workers.CPU_WORKERS_ENV, "0")
    torch.testing.assert_close(mhla_attention(q, k, v, grid, layout, mixing), reference, rtol=1e-10, atol=1e-10)
    assert reader_threads and set(reader_threads) == {threading.current_thread().name}
    assert cpu_workers.chunk_workers() is None


def test_active_modes_keep_the_chunks_in_the_caller(monkeypatch, threads, reader_threads):
    """A dispatch mode (a memory tracker, a profiler, fake tensors) is per thread: with one active the chunks
    run in the calling thread, where the mode sees them. A device context alone does not count."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mhla_diffusion.benchmarks.bench import PeakMemory

    threads(2)
    monkeypatch.setattr(folded_cpu, "CPU_CHUNK_BYTES", 600)
    monkeypatch.delenv(cpu_workers.CPU_WORKERS_ENV, raising=False)
    grid, layout = (4, 6), (2, 3)
    q, k, v, _, _ = make_inputs(grid, seed=8)
    mixing = torch.rand((6, 6), generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.1
    with TorchDispatchMode():
        assert cpu_workers.chunk_workers() is None
    with torch.device("cpu"):
        assert cpu_workers.chunk_workers() is not None
    with torch.no_grad(), PeakMemory() as memory:
        fast = mhla_attention(q, k, v, grid, layout, mixing)
    assert memory.peak > 0
    assert reader_threads and set(reader_threads) == {threading.current_thread().name}
    torch.testing.assert_close(fast, mhla_attention_reference(q, k, v, grid, layout, mixing), rtol=1e-10, atol=1e-10)


def test_inference_mode_reaches_the_workers(monkeypatch, threads, reader_threads):
    """Under torch.inference_mode the buffers are inference tensors, which only inference mode may write in
    place: the workers run in the caller's mode."""
    threads(2)
    monkeypatch.setattr(folded_cpu, "CPU_CHUNK_BYTES", 600)
    monkeypatch.delenv(cpu_workers.CPU_WORKERS_ENV, raising=False)
    grid, layout = (5, 7), (2, 3)
    q, k, v, _, _ = make_inputs(grid, seed=7)
    mixing = torch.rand((6, 6), generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.1
    with torch.inference_mode():
        fast = mhla_attention(q, k, v, grid, layout, mixing)
    torch.testing.assert_close(fast, mhla_attention_reference(q, k, v, grid, layout, mixing), rtol=1e-10, atol=1e-10)
    assert all(name.startswith("mhla-cpu-worker-") for name in reader_threads)


def test_groups_run_whole_and_in_order_on_one_worker(threads):
    """Every chunk once; a group's chunks in order on one worker with one scratch; scratch made only where
    chunks run (a worker that comes after the last group makes none)."""
    threads(3)
    pool = cpu_workers.ChunkWorkers(3)
    try:
        groups = [[(g, p) for p in range(1 + g % 4)] for g in range(40)]
        seen: list[tuple[str, tuple[int, int], int]] = []
        made: list[str] = []

        def scratch() -> int:
            made.append(threading.current_thread().name)
            return len(made)

        pool.run(lambda chunk, buffers: seen.append((threading.current_thread().name, chunk, buffers)), groups, scratch)
        assert sorted(chunk for _, chunk, _ in seen) == sorted(chunk for group in groups for chunk in group)
        assert 1 <= len(made) <= 3 and set(made) == {name for name, _, _ in seen}  # made where chunks ran
        for group in groups:
            runs = [(name, chunk, buffers) for name, chunk, buffers in seen if chunk[0] == group[0][0]]
            assert [chunk for _, chunk, _ in runs] == group
            assert len({name for name, _, _ in runs}) == 1
            assert len({buffers for _, _, buffers in runs}) == 1
        assert torch.get_num_threads() == 3
    finally:
        pool.close(timeout=10)


def test_an_error_in_a_worker_is_raised_and_the_pool_still_works(threads):
    threads(2)
    pool = cpu_workers.ChunkWorkers(2)
    try:

        def work(chunk: int, buffers: None) -> None:
            if chunk == 7:
                raise ValueError("chunk 7 failed")

        with pytest.raises(ValueError, match="chunk 7 failed"):
            pool.run(work, [[i] for i in range(20)], lambda: None)
        done: list[int] = []
        pool.run(lambda chunk, buffers: done.append(chunk), [[i] for i in range(20)], lambda: None)
        assert sorted(done) == list(range(20))
    finally:
        pool.close(timeout=10)


def test_closing_lets_queued_runs_finish_and_a_closed_pool_runs_in_the_caller(threads):
    """A pool replaced while another thread runs on it finishes that run; a run that starts on a closed pool
    runs in its caller (its threads are gone); stopping the runs (interpreter exit) makes them raise."""
    import time

    threads(2)
    pool = cpu_workers.ChunkWorkers(2)
    done: list[tuple[str, int]] = []

    def slow(chunk: int, buffers: None) -> None:
        time.sleep(0.005)
        done.append((threading.current_thread().name, chunk))

    errors: list[BaseException] = []

    def background() -> None:
        try:
            pool.run(slow, [[i] for i in range(100)], lambda: None)
        except BaseException as error:
            errors.append(error)

    runner = threading.Thread(target=background)
    runner.start()
    while not done:  # the run is under way
        time.sleep(0.001)
    pool.close()
    runner.join(60)
    assert not errors and sorted(chunk for _, chunk in done) == list(range(100))
    done.clear()
    pool.run(slow, [[i] for i in range(5)], lambda: None)
    assert done == [(threading.current_thread().name, i) for i in range(5)]
    pool.close(timeout=10)
    assert not any(worker.is_alive() for worker in pool._workers)

    pool = cpu_workers.ChunkWorkers(2)
    done.clear()
    runner = threading.Thread(target=background)
    runner.start()
    while not done:
        time.sleep(0.001)
    pool.close(timeout=10, stop_runs=True)
    runner.join(60)
    assert len(errors) == 1 and "stopped" in str(errors[0]) and len(done) < 100


def test_pool_follows_the_thread_count(monkeypatch, threads):
    """chunk_workers() keeps one pool per thread count and builds a new one when the count changes."""
    monkeypatch.delenv(cpu_workers.CPU_WORKERS_ENV, raising=False)
    threads(2)
    first = cpu_workers.chunk_workers()
    assert first is not None and first.threads == 2 and cpu_workers.chunk_workers() is first
    threads(3)
    second = cpu_workers.chunk_workers()
    assert second is not None and second.threads == 3 and second is not first
    assert torch.get_num_threads() == 3
    with pytest.raises(ValueError, match="at least 2 threads"):
        cpu_workers.ChunkWorkers(1)
