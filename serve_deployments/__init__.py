"""Ray Serve side: the vLLM rollout replica (replica.py) and the Ingress in front of it (ingress.py)."""
