"""The orchestrator policy as a model that writes specs, shared by training (lemon.train) and inference (lemon.eval):
loading it with its LoRA (model), the dtype it samples in (dtype), grammar-constrained sampling of specs (rollout) and
the same policy served by llama-server (served). It sits between lemon.run (workers, servers, weights) and lemon.eval /
lemon.train, so no import points up a stage (tests/test_repo.py checks the graph)."""
