"""A plain PyTorch Lightning run with FSDP2: a LightningModule whose configure_model applies
torch.distributed.fsdp.fully_shard (imported at the top, as Lightning's docs do) on the
ModelParallelStrategy's data-parallel mesh; train, checkpoint, resume. Nothing here knows
about fsdp_compose.

    torchrun --nproc_per_node=2 lightning_script.py --out result.json --output-dir ckpt

Two fits of --steps steps, each with a freshly built module (same seed): one uninterrupted,
saving a (distributed) checkpoint every --save-steps steps; one resumed from the first
(Trainer.fit(ckpt_path=...)). Rank 0 writes to --out, for both, the loss and the sum of the
full gradients at every step and a checksum of every parameter's full tensor at the end
(sum, and sha256 of its bytes), and the FSDP classes of the sharded modules (the modules
their classes come from say whose fully_shard ran). --precision bf16 gives fully_shard a
MixedPrecisionPolicy (bf16 parameters in compute, fp32 gradient reduction).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from record import checksums, fsdp_classes, save, script_arguments  # beside this script
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

VOCAB, SEQ, DIM = 64, 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(L.LightningModule):
    def __init__(self, bf16: bool) -> None:
        super().__init__()
        self.bf16 = bf16
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        self.steps: list[dict[str, float]] = []

    def configure_model(self) -> None:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.bf16 else MixedPrecisionPolicy()
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(self, mesh=mesh, mp_policy=mp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        self.steps.append({"step": self.global_step + 1, "loss": loss.item()})
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
        self.steps[-1]["grad_sum"] = sum(g.double().sum().item() for g in full)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (8, SEQ + 1), generator=generator)
    return torch.utils.data.DataLoader(ids, batch_size=2, shuffle=True)


def fit(args: argparse.Namespace, ckpt_path: str | None) -> TinyLM:
    L.seed_everything(0)
    module = TinyLM(bf16=args.precision == "bf16")
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(args.output_dir, "resumed" if ckpt_path else "."),
        filename="step{step}", auto_insert_metric_name=False,
        every_n_train_steps=args.save_steps, save_top_k=-1,
    )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun; else Lightning's own
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size,
        strategy=ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
        max_steps=args.steps, callbacks=[checkpoints], default_root_dir=args.output_dir,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    return module


def main() -> None:
    args = script_arguments()

    module = fit(args, ckpt_path=None)
    result = {
        "world_size": dist.get_world_size(),
        "fully_shard": f"{fully_shard.__module__}.{fully_shard.__name__}",
        "fsdp_classes": fsdp_classes(module),
        "uninterrupted": {"steps": module.steps, "params": checksums(module)},
    }
    resumed = fit(args, ckpt_path=os.path.join(args.output_dir, f"step{args.save_steps}.ckpt"))
    result["resumed"] = {"steps": resumed.steps, "params": checksums(resumed)}

    save(result, args.out)


if __name__ == "__main__":
    main()
