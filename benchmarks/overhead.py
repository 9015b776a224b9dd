"""CPU overhead per unit of fsdp_compose and torch's fully_shard, in one process: a step's
time minus the unsharded model's, per unit, and the part inside the process group's calls;
beside them the same work written out by hand (HandShardedUnit), the design's own cost.

    python benchmarks/overhead.py                # W=8 fake ranks, 64 Linear(64, 64) units
    python benchmarks/overhead.py --backend gloo # one real gloo rank: no communication
    python benchmarks/overhead.py --block transformer --optimizer
                                                 # 16 transformer blocks, AdamW in each step
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import harness
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import AllgatherOptions

from fsdp_compose import StepTrace
from fsdp_compose.comm.compat import ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD

# Per block, the defaults of --units and --batch: transformer blocks cost more to compute, and
# compute's noise is subtracted with the unsharded step's.
DEFAULTS = {"linear": {"units": 64, "batch": 8}, "transformer": {"units": 16, "batch": 4}}
RUNTIMES = {"unsharded": None, "torch fully_shard": "FSDP2", "fsdp_compose": "fsdp_compose",
            "after a StepTrace": "fsdp_compose", "by hand": "by hand"}
_GATHER = AllgatherOptions()
_AVERAGE = dist.ReduceScatterOptions()
_AVERAGE.reduceOp = dist.ReduceOp.AVG


def _shard(p: torch.Tensor, ranks: int, rank: int, piece: torch.Tensor) -> nn.Parameter:
    """`rank`'s torch.chunk piece of `p` written into `piece` (its padded shard, zero past the
    piece), as a parameter viewing it."""
    rows = -(-p.shape[0] // ranks)
    local = p.detach()[rank * rows:(rank + 1) * rows]
    piece.zero_()
    piece[:local.numel()].copy_(local.reshape(-1))
    return nn.Parameter(piece[:local.numel()].view(local.shape))


class HandShardedUnit:
    """The per-unit work of fully_shard by hand, nothing else (the design's own cost), on the
    parameters of `module`, as a unit of fsdp_compose on the CPU: padded shards back to back
    in one flat tensor, one all-gather into a reused buffer, one `split_with_sizes_copy` into
    unsharded parameters viewing one storage; after the last gradient, one `_chunk_cat` and one
    averaging reduce-scatter added to the shards' `.grad`. Left out is all a runtime is for:
    DTensors, checks, a root, prefetch, mixed precision, meshes, errors, state."""

    def __init__(self, module: nn.Module) -> None:
        group = dist.group.WORLD
        self.group, self.ranks, rank = group, group.size(), group.rank()
        owned = [(m._parameters, n, p) for m in module.modules()
                 for n, p in m._parameters.items() if p is not None]
        self.count = len(owned)
        # Each parameter's padded shard: ceil(rows / ranks) rows, as both runtimes pad.
        self.sizes = [-(-p.shape[0] // self.ranks) * p[0].numel() for _, _, p in owned]
        self.flat = torch.empty(sum(self.sizes))  # this rank's shards: what is sent
        self.shards = list(self.flat.split(self.sizes))
        sharded = [_shard(p, self.ranks, rank, s) for (_, _, p), s in zip(owned, self.shards)]
        if self.ranks == 1:  # the shards are the unsharded data: nothing to gather or free
            unsharded_data, self.outputs, self.storage = self.shards, [], None
        else:
            storage = torch.empty(self.ranks * self.flat.numel())
            unsharded_data = storage.split([self.ranks * size for size in self.sizes])
            # Through .data, which has its own version counter: the copy-out must not bump
            # the one autograd checks on the unsharded parameters it saved. Each output is
            # a parameter's rows, one per rank, as the gathered rows hold its shards.
            self.outputs = [data.view(self.ranks, size) for data, size in zip(
                storage.data.split([self.ranks * size for size in self.sizes]), self.sizes)]
            self.storage, self.nbytes = storage.untyped_storage(), storage.nbytes
            # The all-gather's buffer (row r: rank r's flat shard), allocated per gather.
            self.gathered = torch.empty(self.ranks * self.flat.numel())
            self.rows = self.gathered.view(self.ranks, -1)
            self.gathered_storage = self.gathered.untyped_storage()
            self.gathered_nbytes = self.gathered.nbytes
            self.gathered_storage.resize_(0)
        unsharded = [nn.Parameter(data[:p.numel()].view(p.shape))
                     for data, (_, _, p) in zip(unsharded_data, owned)]
        self.forms = self._by_owner(owned, sharded, unsharded)
        self.sharded, self.unsharded = sharded, unsharded
        self.grads_pending = 0
        self.grad_views: list[torch.Tensor] = []  # see add_to_grads
        offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]  # in the reduced shards
        self.grad_geometry = [(s.shape, s.stride(), o) for s, o in zip(sharded, offsets)]
        for param in unsharded:
            param.register_post_accumulate_grad_hook(self.grad_accumulated)
        self.reshard()
        module.register_forward_pre_hook(self.pre_forward)
        module.register_forward_hook(self.post_forward)

    @staticmethod
    def _by_owner(owned: list, sharded: list, unsharded: list) -> list:
        """(owner's _parameters, sharded by name, unsharded by name): one dict update each."""
        forms: dict[int, tuple] = {}
        for (parameters, name, _), s, u in zip(owned, sharded, unsharded):
            _, s_by_name, u_by_name = forms.setdefault(id(parameters), (parameters, {}, {}))
            s_by_name[name], u_by_name[name] = s, u
        return list(forms.values())

    def unshard(self) -> None:
        if self.storage is not None:
            self.gathered_storage.resize_(self.gathered_nbytes)
            getattr(self.group, ALL_GATHER_METHOD)(self.gathered, self.flat, _GATHER).wait()
            self.storage.resize_(self.nbytes)
            torch.split_with_sizes_copy(self.rows, self.sizes, dim=1, out=self.outputs)
            self.gathered_storage.resize_(0)
        for parameters, _, unsharded in self.forms:
            parameters.update(unsharded)

    def reshard(self) -> None:
        for parameters, sharded, _ in self.forms:
            parameters.update(sharded)
        if self.storage is not None:
            self.storage.resize_(0)

    def pre_forward(self, module: nn.Module, args: object) -> None:
        self.unshard()

    def post_forward(self, module: nn.Module, args: object, output: torch.Tensor) -> None:
        self.reshard()
        output.grad_fn.register_prehook(self.pre_backward)

    def pre_backward(self, grads: object) -> None:
        self.grads_pending = self.count
        self.unshard()

    def grad_accumulated(self, _param: nn.Parameter) -> None:
        self.grads_pending -= 1
        if self.grads_pending:
            return
        grads = []
        for param in self.unsharded:
            grads.append(param.grad)
            param.grad = None
        if self.ranks == 1:  # as fsdp_compose: each gradient is its own reduced shard
            for shard, grad in zip(self.sharded, grads):
                if shard.grad is None:
                    shard.grad = grad
                else:
                    shard.grad.add_(grad)
            self.reshard()
            return
        rows = torch._chunk_cat(grads, dim=0, num_chunks=self.ranks)  # row r: rank r's
        reduced = rows.new_empty(self.flat.numel())
        getattr(self.group, REDUCE_SCATTER_METHOD)(reduced, rows.view(-1), _AVERAGE).wait()
        self.add_to_grads(reduced)
        self.reshard()

    def add_to_grads(self, reduced: torch.Tensor) -> None:
        """Add the reduced shards (padded, back to back) to the shards' `.grad`s: with one op
        while those are the views of an earlier `reduced` that this made them (gradient
        accumulation, as fsdp_compose's ledger does), else each on its own."""
        if self.grad_views and all(s.grad is g for s, g in zip(self.sharded, self.grad_views[1:])):
            self.grad_views[0].add_(reduced)
            return
        views = [reduced]
        for shard, (shape, stride, offset) in zip(self.sharded, self.grad_geometry):
            grad = reduced.as_strided(shape, stride, offset)  # one view op for three
            views.append(grad)
            if shard.grad is None:
                shard.grad = grad
            else:
                shard.grad.add_(grad)
        # Kept only when every .grad is now a view of `reduced` (all were None).
        fresh = all(s.grad is g for s, g in zip(self.sharded, views[1:]))
        self.grad_views = views if fresh else []


class Contender:
    """A model and, with --optimizer, its AdamW (foreach, as on accelerators by default)."""

    def __init__(self, args: argparse.Namespace, runtime: str | None) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(*(nn.Linear(args.dim, args.dim) if args.block == "linear"
                                     else harness.Block(args.dim) for _ in range(args.units)))
        if runtime == "by hand":
            for layer in self.model:  # each unit's hooks keep it alive
                HandShardedUnit(layer)
        elif runtime is not None:
            harness.shard(self.model, self.model, runtime,
                          mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True) \
            if args.optimizer else None

    def steps(self, x: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            self.model(x).sum().backward()
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad()


@contextmanager
def collective_clock():
    """[seconds, calls] inside the process group's all-gathers and reduce-scatters."""
    clock, originals = [0.0, 0], {name: getattr(ProcessGroup, name)
                                  for name in (ALL_GATHER_METHOD, REDUCE_SCATTER_METHOD)}

    def timed(original):
        def call(*args):
            start = time.perf_counter()
            try:
                return original(*args)
            finally:
                clock[0] += time.perf_counter() - start
                clock[1] += 1
        return call

    for name, original in originals.items():
        setattr(ProcessGroup, name, timed(original))
    try:
        yield clock
    finally:
        for name, original in originals.items():
            setattr(ProcessGroup, name, original)


def check_by_hand(args: argparse.Namespace, x: torch.Tensor) -> None:
    """The hand-written units compute fsdp_compose's gradient shards, to the last bit."""
    ours, by_hand = Contender(args, "fsdp_compose").model, Contender(args, "by hand").model
    for model in (ours, by_hand):
        for _ in range(2):  # the second adds to the first's .grad
            model(x).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), by_hand.parameters(), strict=True):
        if not torch.equal(p.grad.to_local(), q.grad):
            raise AssertionError(f"the hand-written units' gradient of {name} is not ours")


def measure(args: argparse.Namespace, x: torch.Tensor) -> dict[str, dict]:
    """Each contender's step time per round, and in rounds apart (the clock's cost stays out
    of the step times) the time and calls inside the collectives."""
    contenders = {name: Contender(args, runtime) for name, runtime in RUNTIMES.items()}
    for contender in contenders.values():
        contender.steps(x, 3)  # warm up: lazy init, allocator, optimizer state
    with StepTrace(contenders["after a StepTrace"].model):
        contenders["after a StepTrace"].steps(x, 1)
    runs = {name: (lambda c=c: c.steps(x, args.steps)) for name, c in contenders.items()}
    times = {name: [t / args.steps for t in samples]
             for name, samples in harness.interleaved(runs, args.repeats).items()}
    inside: dict[str, list[float]] = {name: [] for name in contenders}
    calls: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, run in runs.items():
            with collective_clock() as clock:
                run()
            inside[name].append(clock[0] / args.steps)
            calls[name] = clock[1] / args.steps / args.units
    floor, variants = statistics.median(times["unsharded"]), {}
    for name, samples in times.items():
        per_unit = (statistics.median(samples) - floor) / args.units * 1e6
        in_collectives = statistics.median(inside[name]) / args.units * 1e6
        variants[name] = {
            "step_seconds": statistics.median(samples), "step_samples": samples,
            "us_per_unit": per_unit, "collectives_us_per_unit": in_collectives,
            "runtime_us_per_unit": per_unit - in_collectives, "collective_samples": inside[name],
            "calls_per_unit": calls[name]}
    for variant in variants.values():
        variant["vs_fsdp2"] = variant["us_per_unit"] / variants["torch fully_shard"]["us_per_unit"]
    return variants


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--backend", choices=("fake", "gloo"), default="fake")
    parser.add_argument("--block", choices=tuple(DEFAULTS), default="linear",
                        help="what a unit is")
    parser.add_argument("--optimizer", action="store_true", help="an AdamW step in every step")
    parser.add_argument("--units", type=int, help="64 Linear, 16 transformer blocks")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    args.units = args.units or DEFAULTS[args.block]["units"]
    # Not options: the setting the CPU-overhead goal is read against (report.py).
    args.dim, args.seq, args.batch = 64, 16, DEFAULTS[args.block]["batch"]
    key = args.backend if args.block == "linear" and not args.optimizer else \
        f"{args.backend}, {args.block}" + (" + AdamW" if args.optimizer else "")
    config, started = harness.config(args), time.perf_counter()
    with harness.process_group(args.backend, 8 if args.backend == "fake" else 1):
        torch.set_num_threads(1)
        x = torch.randn((args.batch, args.dim) if args.block == "linear" else
                        (args.batch, args.seq, args.dim))
        check_by_hand(args, x)
        variants = measure(args, x)
        config["world_size"] = dist.get_world_size()
    unit = f"Linear({args.dim}, {args.dim})" if args.block == "linear" else \
        f"transformer block (dim {args.dim}, seq {args.seq}, 12 parameters)"
    print(f"torch {torch.__version__}  {args.backend}  world={config['world_size']}  "
          f"{args.units} x {unit}  batch {args.batch}{'  + AdamW' if args.optimizer else ''}  "
          f"median of {args.repeats}\n{'variant':<20}{'step ms':>10}{'us / unit':>12}"
          f"{'collectives':>14}{'runtime':>10}{'calls / unit':>14}")  # tests read the rows
    for name, v in variants.items():
        print(f"{name:<20}{v['step_seconds'] * 1e3:>10.2f}{v['us_per_unit']:>12.1f}"
              f"{v['collectives_us_per_unit']:>14.1f}{v['runtime_us_per_unit']:>10.1f}"
              f"{v['calls_per_unit']:>14.2f}")
    print("per unit, against torch fully_shard: " + ", ".join(
        f"{name} {variants[name]['vs_fsdp2']:.3f}" for name in list(RUNTIMES)[2:]))
    config["wall_seconds"] = time.perf_counter() - started
    path = args.out / "overhead.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = {"config": config, "variants": variants}  # beside other runs'
    harness.write(args.out, "overhead", results)


if __name__ == "__main__":
    main()
