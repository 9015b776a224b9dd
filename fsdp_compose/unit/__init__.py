"""How: a unit as one part per mesh, each laid out once and gathered, resharded and
reduced over its mesh, with its gradients held in a ledger until backward commits."""
