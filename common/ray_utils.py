"""Ray helpers every side uses: find a named actor of the run, end an actor, start or join Ray.

The driver, the train workers, the rollout workers and the tools all reach the run's named actors
(registry, buffer, metrics) through `named_actor`, and end what they started with `kill_actor`.
"""
from __future__ import annotations

from common.names import NAMESPACE


def named_actor(name: str | None):
    """The named actor in the project namespace, when a name is given and this process is in Ray."""
    if not name:
        return None
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_actor(name, namespace=NAMESPACE)


def kill_actor(actor) -> None:
    """End an actor this process started; one already gone is not an error."""
    import ray

    if actor is None:
        return
    try:
        ray.kill(actor)
    except Exception:  # already dead
        pass
