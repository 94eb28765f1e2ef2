"""The ingress as one run sees it: on a fleet every rollout call names the run (`run=RUN`), so its versions
are the run's own (`RUN/policy-vN`); a standalone run's calls stay exactly what they were.

    ingress = ingress_for(cfg)          # in a rollout worker, the evaluator, the driver
    await ingress.generate_group.remote(ids, n, version, sampling)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import Config

# The ingress methods that read or pin a run's versions.
RUN_METHODS = frozenset({"generate_group", "pin_version", "live_versions", "registry_sha"})


def fleet_run(cfg: Config) -> str:
    """The run's name on its fleet, "" for a standalone run (a fleet of one run named "")."""
    return cfg.run.name if cfg.run.fleet else ""


def run_namespace_of(cfg: Config) -> str:
    """The Ray namespace of the run's own actors (common.names.run_namespace)."""
    from common.names import run_namespace

    return run_namespace(fleet_run(cfg))


class _RunMethod:
    def __init__(self, method, run: str):
        self._method, self._run = method, run

    def remote(self, *args, **kwargs):
        return self._method.remote(*args, run=self._run, **kwargs)


class RunIngress:
    """A DeploymentHandle of the ingress whose run-scoped methods carry `run`."""

    def __init__(self, handle, run: str):
        self._handle, self._run = handle, run

    def __getattr__(self, name: str):
        method = getattr(self._handle, name)
        return _RunMethod(method, self._run) if self._run and name in RUN_METHODS else method


def ingress_for(cfg: Config):
    """The run's view of its Serve app's ingress (rollout.app_name: the run's own app, or its fleet's)."""
    from ray import serve

    return RunIngress(serve.get_app_handle(cfg.rollout.app_name), fleet_run(cfg))
