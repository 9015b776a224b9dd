"""When: the hooks and their phases, the root of a model's units, prefetch, the rules for
when a unit's backward is done, the collectives in flight per root, the first forward's
checks, tied parameters, and where a module's unit state is found. Hooks decide when,
units decide how."""
