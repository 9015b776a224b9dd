"""Checkpoints, which need no runtime: sharded ones through torch.distributed.checkpoint
and whole safetensors files streamed a tensor at a time, validated before loading."""
