"""The `ranks` fixture: pools of gloo worker processes, started once for the whole run.

Spawning processes and creating a process group takes seconds while a test body takes
milliseconds, so each world size gets one pool whose workers run test functions sent to
them. A test function lives at module level (the workers import it) and runs on every rank.
A rank stuck in a collective fails the test by a timeout; a rank whose process crashes
natively gets its test run once more on a fresh pool (see Ranks.run).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from tests import shifted_torch

TASK_TIMEOUT_S = 120  # a whole test function on every rank
AFTER_ERROR_S = 10  # how long the other ranks get once one rank has failed
COLLECTIVE_TIMEOUT_S = 60  # gloo's own timeout: a hung collective raises in the worker


def _serve(rank: int, world_size: int, init_file: str, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank that crashes natively prints where, under its test's output
    shifted_torch.install()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    while (task := tasks.get()) is not None:  # None means: shut down
        fn, kwargs = task
        try:
            value = fn(**kwargs)
            pickle.dumps(value)  # the queue would drop an unpicklable result silently
            results.put((rank, None, value))
        except BaseException:
            results.put((rank, traceback.format_exc(), None))
    dist.destroy_process_group()


class RankDied(AssertionError):
    """A rank's process ended while running a test (a native crash: see its output)."""


class RankPool:
    """`world_size` worker processes in one gloo process group."""

    def __init__(self, world_size: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self._init_file = os.path.join(tempfile.mkdtemp(prefix="fsdp_compose_pg_"), "init")
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._results = context.Queue()
        self._workers = [
            context.Process(
                target=_serve, args=(rank, world_size, self._init_file, tasks, self._results),
                daemon=True,
            )
            for rank, tasks in enumerate(self._tasks)
        ]
        for worker in self._workers:
            worker.start()
        self.alive = True

    def run(self, fn: Callable[..., Any], timeout: float, **kwargs: Any) -> list[Any]:
        """Run `fn(**kwargs)` on every rank; return each rank's result, by rank."""
        for tasks in self._tasks:
            tasks.put((fn, kwargs))
        done: dict[int, tuple[str | None, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            try:
                rank, error, value = self._results.get(timeout=1)
                done[rank] = (error, value)
                if error is not None:
                    deadline = min(deadline, time.monotonic() + AFTER_ERROR_S)
                continue
            except queue.Empty:
                pass
            dead = [r for r, w in enumerate(self._workers) if not w.is_alive() and r not in done]
            if dead or time.monotonic() > deadline:
                self.close(kill=True)
                errors = "".join(f"\nrank {r}:\n{e}" for r, (e, _) in sorted(done.items()) if e)
                where = f"{fn.__name__} at world size {self.world_size}"
                if dead:
                    exits = {r: self._workers[r].exitcode for r in dead}
                    raise RankDied(f"{where}: ranks {dead} died (exit codes {exits}).{errors}")
                missing = sorted(set(range(self.world_size)) - set(done))
                raise AssertionError(
                    f"{where}: ranks {missing} did not finish (hung collective?); "
                    f"the pool restarts.{errors}"
                )
        errors = "".join(f"\nrank {r}:\n{e}" for r, (e, _) in sorted(done.items()) if e)
        if errors:
            raise AssertionError(f"{fn.__name__} at world size {self.world_size} failed:{errors}")
        return [done[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        for worker, tasks in zip(self._workers, self._tasks):
            if kill:
                worker.kill()
            else:
                tasks.put(None)
        for worker in self._workers:
            worker.join(timeout=10)
        shutil.rmtree(os.path.dirname(self._init_file), ignore_errors=True)


class Ranks:
    """`ranks.run(fn, world_size=2, **kwargs)`: fn(**kwargs) on every rank of a pool."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def run(
        self, fn: Callable[..., Any], *, world_size: int = 2, timeout: float = TASK_TIMEOUT_S,
        retire_pool: bool = False, **kwargs: Any,
    ) -> list[Any]:
        """`retire_pool`: the test leaves the ranks' communication broken on purpose (say,
        a timed-out collective), so the next test gets a fresh pool."""
        try:
            return self._pool(world_size).run(fn, timeout, **kwargs)
        except RankDied as death:
            # A process that dies without a Python error crashed in native code (gloo's
            # threads, the allocator). Run the test once more on fresh processes: a crash
            # that repeats fails it, one that does not is reported as a warning.
            warnings.warn(f"{death}\nran again on a fresh pool", RuntimeWarning, stacklevel=2)
            return self._pool(world_size).run(fn, timeout, **kwargs)
        finally:
            if retire_pool:
                self._pools[world_size].close(kill=True)

    def _pool(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def ranks() -> Any:
    pools = Ranks()
    yield pools
    pools.close()


# The check of the checks (tests/shifted_torch.py): a test that ran torch's shifted
# fully_shard and passed compares none of torch's values.
UNCHECKED: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "torch_values_unused(why): runs torch's fully_shard but compares none of "
        "its values (placements, errors, bytes), so a shifted torch cannot fail it",
    )
    if shifted_torch.shift():
        os.environ[shifted_torch.MARKS_ENV] = tempfile.mkdtemp(prefix="fsdp_compose_shift_")
        shifted_torch.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not shifted_torch.shift():
        return
    if shifted_torch.take_marks() and report.passed:
        if item.get_closest_marker("torch_values_unused") is None:
            UNCHECKED.append(item.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if shifted_torch.shift():
        terminalreporter.section("tests that passed with torch's fully_shard shifted")
        terminalreporter.line("\n".join(UNCHECKED) or "none")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if shifted_torch.shift():
        # Under the shift, failures are expected; a passing parity test is the error.
        session.exitstatus = 1 if UNCHECKED else 0
