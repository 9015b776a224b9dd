"""StepTrace: the spans of one traced step hold the analytic bytes of every collective,
in forward and backward order; the Chrome trace has one event per collective; spans show
in torch.profiler; a model once traced trains exactly as one never traced."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import StepTrace, fully_shard
from tests.dist.counting import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter
from tests.dist.parity import make_mesh, max_diff_to, per_block
from tests.models import Transformer, lm_loss, token_batch
from tests.torch_support import needs_shard_placement_result


def annotated() -> torch.nn.Module:
    torch.manual_seed(0)
    model = Transformer()
    per_block(model, fully_shard, mesh=make_mesh())
    lm_loss(model, token_batch(0, 2)).backward()  # the first step: lazy init
    return model


def unit_bytes(params: list[torch.Tensor], world: int) -> int:
    """A unit's all-gather (and reduce-scatter) buffer: every rank's padded shards, float32."""
    return 4 * world * sum(math.ceil(p.shape[0] / world) * p[0].numel() for p in params)


def check_spans(path: str) -> dict[str, object]:
    model = annotated()
    world = dist.get_world_size()
    with CollectiveCounter() as counter, StepTrace(model) as trace:
        lm_loss(model, token_batch(1, 2)).backward()
    trace.save_chrome(path)
    root_own = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    expected = {
        "": unit_bytes(root_own, world),
        **{
            f"blocks.{i}": unit_bytes(list(b.parameters()), world)
            for i, b in enumerate(model.blocks)
        },
    }
    spans = sorted(trace.spans, key=lambda s: s.start)
    return {
        "expected": expected,
        "gathers": [(s.phase, s.unit, s.nbytes) for s in spans if s.kind == "all-gather"],
        "reductions": [(s.unit, s.nbytes) for s in spans if s.kind == "reduce-scatter"],
        "forward computes": [s.unit for s in spans if s.kind == "compute" and s.phase == "forward"],
        "counted": {
            ALL_GATHER: counter.counts[ALL_GATHER], REDUCE_SCATTER: counter.counts[REDUCE_SCATTER]
        },
        "table": trace.table(),
    }


def test_spans_hold_the_analytic_bytes_in_order(ranks, tmp_path):
    path = str(tmp_path / "trace.json")
    result = ranks.run(check_spans, path=path)[0]
    b = result["expected"]
    # Forward gathers root then blocks; backward gathers the blocks again (the root keeps
    # its parameters) from the last, and reduces from the last block to the root.
    assert result["gathers"] == [
        ("forward", "", b[""]), ("forward", "blocks.0", b["blocks.0"]),
        ("forward", "blocks.1", b["blocks.1"]), ("backward", "blocks.1", b["blocks.1"]),
        ("backward", "blocks.0", b["blocks.0"]),
    ]
    assert result["reductions"] == [
        ("blocks.1", b["blocks.1"]), ("blocks.0", b["blocks.0"]), ("", b[""])
    ]
    assert result["forward computes"] == ["", "blocks.0", "blocks.1"]
    assert "blocks.1" in result["table"] and "not hidden by compute" in result["table"]
    # The Chrome trace: rank lanes, and one event per collective each rank issued.
    events = json.loads(open(path).read())["traceEvents"]
    for rank in range(2):
        lanes = {e["args"]["name"]: e["tid"] for e in events
                 if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == rank}
        for kind, op in (("all-gather", ALL_GATHER), ("reduce-scatter", REDUCE_SCATTER)):
            issued = [e for e in events
                      if e["ph"] == "X" and e["pid"] == rank and e["tid"] == lanes[kind]]
            assert len(issued) == result["counted"][op], kind
    assert any(e["ph"] == "C" and e["name"] == "memory" for e in events)


def check_profiler_labels() -> list[str]:
    model = annotated()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with StepTrace(model):
            lm_loss(model, token_batch(1, 2)).backward()
    return sorted({e.key for e in profile.key_averages() if e.key.startswith("fsdp::")})


def test_spans_show_in_torch_profiler(ranks):
    labels = ranks.run(check_profiler_labels)[0]
    assert "fsdp::blocks.0 all-gather forward" in labels
    assert "fsdp::blocks.1 reduce-scatter" in labels


def check_untraced_after() -> float:
    model, other = annotated(), annotated()  # the same, built twice
    with StepTrace(model):
        lm_loss(model, token_batch(1, 2)).backward()
    lm_loss(other, token_batch(1, 2)).backward()
    for m in (model, other):
        for p in m.parameters():
            p.grad = None
    for step in range(2, 4):
        for m in (model, other):
            lm_loss(m, token_batch(step, 2)).backward()
    return max_diff_to(model, other, grads=True)


def test_trains_the_same_after_a_trace(ranks):
    assert ranks.run(check_untraced_after) == [0.0, 0.0]


def check_png(path: str) -> int:
    pytest.importorskip("matplotlib")
    model = annotated()
    with StepTrace(model) as trace:
        lm_loss(model, token_batch(1, 2)).backward()
    path = f"{path}.{dist.get_rank()}.png"
    trace.save_png(path)
    return len(open(path, "rb").read())


def test_png(ranks, tmp_path):
    pytest.importorskip("matplotlib")
    sizes = ranks.run(check_png, path=str(tmp_path / "rank"))
    assert all(size > 10_000 for size in sizes)


def check_one_at_a_time() -> str:
    model = annotated()
    with StepTrace(model):
        with pytest.raises(RuntimeError) as raised:
            with StepTrace(model):
                pass
    with StepTrace(model):  # the first closed: a new one opens
        lm_loss(model, token_batch(1, 2)).backward()
    return str(raised.value)


def test_one_trace_at_a_time(ranks):
    for message in ranks.run(check_one_at_a_time):
        assert "another trace is open" in message


def check_parameters_on_two_meshes() -> tuple[list[tuple[str, str, int]], dict[str, int]]:
    """A unit whose (36, 12) weights are on an HSDP mesh of their own gathers twice per
    pass: both all-gathers are spans of their own."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    info = HSDPMeshInfo(make_mesh((2, 2)), shard_mesh_dim=1, replicate_mesh_dim=0)
    torch.manual_seed(0)
    model = Transformer()
    per_block(model, fully_shard, mesh=make_mesh(), shard_placement_fn=lambda p: (
        ShardPlacementResult(Shard(0), info) if p.shape == (36, 12) else None))
    lm_loss(model, token_batch(0, 4)).backward()
    with CollectiveCounter() as counter, StepTrace(model) as trace:
        lm_loss(model, token_batch(1, 4)).backward()
    spans = [(s.unit, s.kind, s.nbytes) for s in sorted(trace.spans, key=lambda s: s.start)
             if s.kind != "compute"]
    return spans, {
        ALL_GATHER: counter.counts[ALL_GATHER], REDUCE_SCATTER: counter.counts[REDUCE_SCATTER]
    }


@needs_shard_placement_result
def test_parameters_on_two_meshes(ranks):
    spans, counted = ranks.run(check_parameters_on_two_meshes, world_size=4)[0]
    assert sum(kind == "all-gather" for _, kind, _ in spans) == counted[ALL_GATHER]
    assert sum(kind == "reduce-scatter" for _, kind, _ in spans) == counted[REDUCE_SCATTER]
    block_gathers = [n for unit, kind, n in spans if unit == "blocks.0" and kind == "all-gather"]
    assert len(block_gathers) == 4 and len(set(block_gathers)) == 2  # two meshes, two passes


def check_accumulation() -> dict[str, object]:
    """Two micro-batches, the first without gradient sync: each unit computes one backward per
    micro-batch, reduces once, and the root's compute is told apart from its blocks'."""
    model = annotated()
    with StepTrace(model) as trace:
        model.set_requires_gradient_sync(False)
        lm_loss(model, token_batch(1, 2)).backward()
        model.set_requires_gradient_sync(True)
        lm_loss(model, token_batch(2, 2)).backward()
    spans = sorted(trace.spans, key=lambda s: s.start)
    forwards = [s for s in spans if s.kind == "compute" and s.phase == "forward"]
    second_forward = [s.start for s in forwards if s.unit == ""][1]
    backwards = [s for s in spans if s.kind == "compute" and s.phase == "backward"]
    root_rows = [line for line in trace.table().splitlines() if line.startswith("forward  (root)")]
    root = next(s for s in forwards if s.unit == "")
    return {
        "backwards": sorted((s.unit, 1) for s in backwards),
        "first backwards end before the second forward": all(
            s.end <= second_forward for s in backwards if s.start < second_forward),
        "reductions": sorted(s.unit for s in spans if s.kind == "reduce-scatter"),
        "root own ms": float(root_rows[0].split()[2]) if root_rows else None,
        "root span ms": sum((s.end - s.start) * 1e3 for s in forwards if s.unit == ""),
        "root first span ms": (root.end - root.start) * 1e3,
        "table": trace.table(),
    }


def test_a_trace_under_accumulation_shows_each_backward_and_only_the_reductions_made(ranks):
    result = ranks.run(check_accumulation)[0]
    units = ["", "blocks.0", "blocks.1"]
    assert result["backwards"] == sorted((u, 1) for u in units for _ in range(2)), result
    assert result["first backwards end before the second forward"], result
    assert result["reductions"] == sorted(units), result  # the synced micro-batch's only
    assert (
        result["root own ms"] is not None and result["root own ms"] < result["root span ms"]
    ), result
    assert "compute: each unit's own" in result["table"]
