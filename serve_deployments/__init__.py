"""Ray Serve side: the vLLM rollout replica (replica.py) and the router/ingress in front of it."""
