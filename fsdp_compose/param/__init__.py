"""One parameter: its sharded DTensor and unsharded form, its local tensor, tensor
parallelism, the all-gather extension, the shard shapes, and the policies it follows."""
