"""What users call: fully_shard and the FSDPModule it makes (its setters), and the rest of
the public API around them; it builds units and unit states and hands them to the schedule."""
