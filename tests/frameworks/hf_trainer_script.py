"""A plain transformers Trainer run with FSDP2 (accelerate's fully_shard path) on a tiny
random Llama: train, checkpoint, resume. Nothing here knows about fsdp_compose.

    torchrun --nproc_per_node=2 hf_trainer_script.py --out result.json --output-dir ckpt

On CPU accelerate needs tests/frameworks/cpu_shim.py in front (it refuses FSDP there):

    torchrun --nproc_per_node=2 -m tests.frameworks.cpu_shim hf_trainer_script.py ...

Two trainings of --steps steps, each with a freshly built model (same seed): one
uninterrupted, saving a checkpoint every --save-steps steps; one resumed from the first
checkpoint (Trainer.train(resume_from_checkpoint=...)). Rank 0 writes to --out the logged
loss and grad norm of every step of both, a checksum of every parameter's full tensor at the
end of both (sum, and sha256 of its bytes), and the FSDP classes of the sharded modules (the
modules their classes come from say whose fully_shard ran).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp
from record import checksums, fsdp_classes, save, script_arguments  # beside this script
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed

VOCAB, SEQ = 128, 16


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every run (a generator of their own)."""

    def __init__(self, size: int, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model() -> LlamaForCausalLM:
    set_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def training_args(output_dir: str, steps: int, save_steps: int, bf16: bool) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        report_to="none",
        seed=0,
        data_seed=0,
        use_cpu=not torch.cuda.is_available(),
        bf16=bf16,
        dataloader_num_workers=0,
        disable_tqdm=True,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "reshard_after_forward": True,
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    )


def step_logs(trainer: Trainer) -> list[dict[str, float]]:
    return [
        {"step": e["step"], "loss": e["loss"], "grad_norm": float(e["grad_norm"])}
        for e in trainer.state.log_history if "loss" in e
    ]


def main() -> None:
    args = script_arguments()
    bf16 = args.precision == "bf16"
    data = SyntheticTokens(8)

    run_args = training_args(args.output_dir, args.steps, args.save_steps, bf16)
    trainer = Trainer(model=build_model(), args=run_args, train_dataset=data)
    trainer.train()
    result = {
        "world_size": dist.get_world_size(),
        "fully_shard": f"{fsdp.fully_shard.__module__}.{fsdp.fully_shard.__name__}",
        "fsdp_classes": fsdp_classes(trainer.model),
        "uninterrupted": {"steps": step_logs(trainer), "params": checksums(trainer.model)},
    }

    checkpoint = os.path.join(args.output_dir, f"checkpoint-{args.save_steps}")
    resume_args = training_args(
        os.path.join(args.output_dir, "resumed"), args.steps, args.save_steps, bf16
    )
    resumed = Trainer(model=build_model(), args=resume_args, train_dataset=data)
    resumed.train(resume_from_checkpoint=checkpoint)
    result["resumed"] = {"steps": step_logs(resumed), "params": checksums(resumed.model)}

    save(result, args.out)


if __name__ == "__main__":
    main()
