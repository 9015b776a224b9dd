"""The side-stream protocol of _streams.py, run on the CPU: a recording stand-in for
SideStreams takes the place of the CUDA streams, so the gloo ranks take the accelerator's
code path (collectives issued inside the stream contexts, events waited for). The runs
must train like torch's fully_shard, and the log must show every rule of _streams.py
kept: tests/test_cuda.py checks the same on a GPU, with real streams."""

from __future__ import annotations

import itertools
from contextlib import contextmanager

from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_compose.unit.gather as gather_module
import fsdp_compose.unit.reduce as reduce_module
from fsdp_compose import fully_shard
from fsdp_compose.comm.collectives import ReusedBuffer, all_gather, all_reduce, reduce_scatter
from tests.dist.checks import check_hsdp_accumulation_without_all_reduce
from tests.dist.parity import train_and_compare
from tests.models import Transformer, lm_loss, token_batch

LOG: list[str] = []  # per worker process
EVENT_IDS = itertools.count()
STEPS = 3  # train_and_compare's


class RecordedEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        LOG.append(name)

    def wait(self, stream=None) -> None:
        LOG.append(f"wait {self.name}")


@contextmanager
def logged_stream(name: str):
    LOG.append(name)
    yield
    LOG.append(f"/{name}")


class RecordingStreams:
    """Logs each step of the protocol instead of ordering streams."""

    def follow_compute(self, event=None) -> None:
        LOG.append("follow_compute")

    def gathering(self):
        return logged_stream("gathering")

    def gathered(self) -> RecordedEvent:
        return RecordedEvent(f"gathered#{next(EVENT_IDS)}")

    def copied_out(self) -> None:
        LOG.append("copied_out")

    def reducing(self):
        return logged_stream("reducing")

    def reduced(self) -> RecordedEvent:
        return RecordedEvent(f"reduced#{next(EVENT_IDS)}")


class LoggedBuffer(ReusedBuffer):
    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def take(self, *args):
        LOG.append(f"take {self.kind}")
        return super().take(*args)

    def release(self) -> None:
        LOG.append(f"release {self.kind}")
        super().release()


def logged_all_gather(output, shard, group, ranks, async_op, custom=None):
    LOG.append("all_gather")
    assert not async_op, "on side streams the collectives are issued synchronously"
    return all_gather(output, shard, group, ranks, async_op, custom)


def logged_reduce_scatter(*args, async_op=True):
    LOG.append("reduce_scatter")
    assert not async_op, "on side streams the collectives are issued synchronously"
    return reduce_scatter(*args, async_op=async_op)


def logged_all_reduce(*args):
    LOG.append("all_reduce")
    return all_reduce(*args)


def shard_on_recorded_streams(module, **kwargs):
    fully_shard(module, **kwargs)
    unit = module._state().unit
    (part,) = unit.parts
    unit.streams = part.streams = RecordingStreams()
    unit.gatherers[0]._buffer, unit.reducers[0]._buffer = (
        LoggedBuffer("gather"), LoggedBuffer("reduce")
    )
    return module


@contextmanager
def logged_collectives():
    """The collectives our units send, logged (from a clear log)."""
    LOG.clear()
    gather_module.all_gather = logged_all_gather
    reduce_module.reduce_scatter, reduce_module.all_reduce = (
        logged_reduce_scatter, logged_all_reduce
    )
    try:
        yield
    finally:
        gather_module.all_gather = all_gather
        reduce_module.reduce_scatter, reduce_module.all_reduce = reduce_scatter, all_reduce


def check_protocol(**shard_kwargs) -> tuple[float, list[str]]:
    """Train like tests/dist/parity.py does, our units on recorded streams."""
    with logged_collectives():
        errors = train_and_compare(
            lambda: Transformer(depth=3), lm_loss, lambda step, n: token_batch(step, n),
            shard_fns=(shard_on_recorded_streams, torch_fully_shard), **shard_kwargs,
        )
    return errors.vs_torch, list(LOG)


def assert_rules_kept(log: list[str], gathers_from_kept_pieces: int = 0) -> None:
    """`gathers_from_kept_pieces` per step: each also follows the compute stream, which wrote
    the pieces (reshard_after_forward=<int>)."""
    assert log.count("follow_compute") == STEPS * (1 + gathers_from_kept_pieces), (
        "the gathers follow the compute stream once per forward and before each gather of "
        "kept pieces"
    )
    open_context = None
    waited_gathers: list[str] = []  # waited for, not yet copied out
    reductions_waited = reductions_released = 0
    for i, entry in enumerate(log):
        if entry in ("gathering", "reducing"):
            open_context = entry
        elif entry in ("/gathering", "/reducing"):
            kind = "gathered" if entry == "/gathering" else "reduced"
            assert log[i - 1].startswith(kind + "#"), (
                f"{entry}: the event comes last: {log[i - 3:i + 1]}"
            )
            open_context = None
        elif entry == "all_gather":
            assert open_context == "gathering", f"all-gather outside the all-gather stream at {i}"
        elif entry == "reduce_scatter":
            assert open_context == "reducing", f"reduce-scatter outside its stream at {i}"
        elif entry == "all_reduce":
            assert open_context == "reducing" and log[i - 1] == "reduce_scatter", (
                f"HSDP's all-reduce at {i} is not right after the reduce-scatter on its stream"
            )
        elif entry == "take gather":
            assert open_context == "gathering", (
                "the gathered buffer belongs to the all-gather stream"
            )
        elif entry == "take reduce":
            assert open_context is None, "the reduction's input belongs to the compute stream"
        elif entry.startswith("wait gathered#"):
            waited_gathers.append(entry)
        elif entry == "copied_out":
            assert waited_gathers, f"a copy-out at {i} before waiting for its gather"
            assert log[i - 1] == "release gather", "the buffer is freed, then the event recorded"
            waited_gathers.pop(0)
        elif entry.startswith("wait reduced#"):
            reductions_waited += 1
        elif entry == "release reduce":
            reductions_released += 1
            assert reductions_released <= reductions_waited, (
                f"a reduction's input freed at {i} before the compute stream waited for it"
            )
    issued = [e for e in log if e.startswith(("gathered#", "reduced#"))]
    waits = [e for e in log if e.startswith("wait ")]
    assert sorted(waits) == sorted(f"wait {e}" for e in issued), "every event is waited for once"
    assert log.count("all_gather") > 0 and log.count("reduce_scatter") > 0


def test_side_stream_protocol_trains_like_torch_and_keeps_its_rules(ranks):
    for vs_torch, log in ranks.run(check_protocol, world_size=2):
        assert vs_torch == 0.0
        assert_rules_kept(log)


def test_side_stream_protocol_without_resharding_after_forward(ranks):
    for vs_torch, log in ranks.run(check_protocol, world_size=2, reshard_after_forward=False):
        assert vs_torch == 0.0
        assert_rules_kept(log)


def test_side_stream_protocol_gathering_kept_pieces_after_forward(ranks):
    for vs_torch, log in ranks.run(check_protocol, world_size=4, reshard_after_forward=2):
        assert vs_torch == 0.0
        assert_rules_kept(log, gathers_from_kept_pieces=4)  # three blocks and the root


def test_side_stream_protocol_with_hsdp_all_reduces_on_the_reduce_scatter_stream(ranks):
    for vs_torch, log in ranks.run(check_protocol, world_size=4, mesh_shape=(2, 2)):
        assert vs_torch == 0.0
        assert_rules_kept(log)
        assert log.count("all_reduce") == log.count("reduce_scatter")


def check_hsdp_accumulation_on_recorded_streams() -> list[str]:
    with logged_collectives():
        check_hsdp_accumulation_without_all_reduce((shard_on_recorded_streams, torch_fully_shard))
    return list(LOG)


def test_side_stream_hsdp_accumulation_adds_partial_sums_on_the_reduce_scatter_stream(ranks):
    """Two backwards keep partial sums, the third adds them and all-reduces: like torch."""
    for log in ranks.run(check_hsdp_accumulation_on_recorded_streams, world_size=4):
        assert_rules_kept(log)
        reductions = log.count("reducing")
        assert reductions > 0 and log.count("all_reduce") == reductions // 3
