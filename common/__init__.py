"""Types and helpers that both engines' sides share (config, samples, adapter payloads).

`app/`, `serve_deployments/` and `train_loops/` import this package; it imports none of them.
"""
