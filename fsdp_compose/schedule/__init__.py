"""When: the hooks and their phases, the root of a model's units, prefetch, when a unit's
backward is done, the first forward's checks, tied parameters. Units decide how."""
