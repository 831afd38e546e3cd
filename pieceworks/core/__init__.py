"""The vocabulary that models, backends and the executor share: forward and graph modes, a step's
batch and metadata (`batch`), and the per-forward context the custom ops read (`context`). It sits
below all three, so the executor can stand on top of models and backends."""
