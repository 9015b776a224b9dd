"""The kinds of memory a unit holds beyond its shards (Unit.held_by_kind): each
buffer the runtime keeps, named as tests and traces account for it."""

UNSHARDED = "unsharded parameters"  # a gatherer's storages (the all-gather's output in place)
GATHERED = "all-gather buffer"  # the flat all-gather's output, until copied out
POST_FORWARD = "post-forward pieces"  # kept for reshard_after_forward=<int>
REDUCE_INPUT = "reduce-scatter input"  # the gradients, chunked, until the reduction is done
REDUCE_OUTPUT = "reduce-scatter output"  # a reduction in flight's reduced shards
GRADIENT_LEDGER = "gradient ledger"  # reduced shards until backward ends; sums kept between

KINDS = (UNSHARDED, GATHERED, POST_FORWARD, REDUCE_INPUT, REDUCE_OUTPUT, GRADIENT_LEDGER)
