"""What users call: fully_shard and the FSDPModule it makes (its setters), the argument
checks, shard placements, replicate, wrap, activation checkpointing, initialisation and
the state-dict hooks. It builds units and unit states and hands them to the schedule."""
