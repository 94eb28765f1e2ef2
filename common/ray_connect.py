"""Join a Ray cluster, or start a local one, the way Ray's own CLI does, token authentication included.

Ray 2.60 turns token authentication on for a cluster started where a token exists (`ray start --head` with
~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; a local `ray.init()` always). Ray's CLI and a plain
`ray.init()` switch the client to token mode when a token is at hand, but `ray.init(address=HOST:PORT)` (what
RAY_ADDRESS gives) does not: it then retries for 20 s and fails with "Failed to connect", the same words as for an
address where nothing runs (where it retries for minutes). `connect_ray` asks the cluster's GCS first, one
quick call: nobody there, a cluster that wants a token, or one that refuses the token at hand each get their
own error, saying what to set; a cluster that wants the token this process has gets it.
"""
from __future__ import annotations

import os
from pathlib import Path

AUTH_MODE_ENV = "RAY_AUTH_MODE"
PROBE_TIMEOUT_S = 5.0


class RayConnectError(ConnectionError):
    """No Ray cluster could be joined: the message says why (none there, or its authentication) and what to set."""


def token_source() -> str | None:
    """Where this process's Ray token comes from, in Ray's own order, or None when it has none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"RAY_AUTH_TOKEN_PATH={path}" if Path(path).expanduser().is_file() else None
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def _token_header() -> dict:
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # the environment may have changed since Ray first looked
    return loader.get_token_for_http_header(ignore_auth_mode=True) or {}


def _use_token_mode() -> None:
    """Token mode for this process and the processes it starts, as Ray's CLI sets it (without its warning)."""
    from ray._raylet import Config

    os.environ[AUTH_MODE_ENV] = "token"
    Config.initialize("")  # Ray caches its config: re-read so this process sees token mode


def probe_gcs(address: str, header: dict | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """One call to the GCS at `address` ("HOST:PORT"), with the token `header` if given: "ok",
    "unauthenticated" (the cluster wants a token, or another one) or "unreachable" (no Ray GCS answers)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = grpc.insecure_channel(address)
    try:
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
            gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=tuple((header or {}).items()))
        return "ok"
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            return "unauthenticated"
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return "unreachable"
        return "ok"  # something answered; ray.init says more if it is not a Ray cluster after all
    finally:
        channel.close()


def _resolve(address: str | None) -> str | None:
    """HOST:PORT of the cluster to join (the argument, else RAY_ADDRESS, else the last `ray start` cluster of
    this machine), or None to start a local one; "auto" insists on a running cluster."""
    from ray._private import services

    try:
        return services.canonicalize_bootstrap_address(address)
    except ConnectionError as e:  # "auto" and nothing running
        raise RayConnectError(f"no Ray cluster is running on this machine ({e}); start one with `ray start --head`, "
                              "or set RAY_ADDRESS (or --address) to a running cluster's HOST:PORT") from None


def _check_auth(address: str, where: str) -> None:
    """The cluster at `address` answers: switch to token mode when it wants a token and this process has its
    token; otherwise a RayConnectError saying what to set."""
    state = probe_gcs(address)
    if state == "unreachable":
        port = address.rsplit(":", 1)[-1]
        raise RayConnectError(
            f"no Ray cluster at {where}: nothing answers there; start one with `ray start --head "
            f"--port {port}`, or set RAY_ADDRESS (or --address, run.ray_address) to a running cluster's GCS "
            "HOST:PORT (`ray status` on its head prints it)")
    if state == "ok":
        return
    how = ("set RAY_AUTH_TOKEN_PATH to the cluster's token file (the head's ~/.ray/auth_token of the user who ran "
           "`ray start --head`; `ray get-auth-token` there prints the token) or RAY_AUTH_TOKEN to the token")
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode and mode.lower() != "token":
        raise RayConnectError(f"the Ray cluster at {where} has token authentication on, and "
                              f"{AUTH_MODE_ENV}={mode} here: unset it (or set {AUTH_MODE_ENV}=token) and {how}")
    source = token_source()
    if source is None:
        raise RayConnectError(f"the Ray cluster at {where} has token authentication on and this process "
                              f"has no Ray token: {how}")
    if probe_gcs(address, _token_header()) == "unauthenticated":
        raise RayConnectError(f"the Ray cluster at {where} refused this process's Ray token (from "
                              f"{source}): it is not the cluster's; {how}")
    _use_token_mode()


def connect_ray(address: str | None = None, *, start_local: bool = True, **init_kwargs) -> None:
    """Join the Ray cluster at `address` (else RAY_ADDRESS, else the last `ray start` cluster of this machine)
    or, with start_local and none of those, start a local one; `init_kwargs` go to `ray.init`. A cluster with
    token authentication is joined with this process's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
    ~/.ray/auth_token), as Ray's CLI does. Raises RayConnectError saying why (no cluster there, or its
    authentication) and what to set. A process already in Ray keeps its connection."""
    import ray

    if ray.is_initialized():
        return
    resolved = _resolve(address if address or start_local else "auto")
    if resolved is None:  # a new local cluster: token mode is Ray's default there; set here, Ray does not warn
        if AUTH_MODE_ENV not in os.environ:
            _use_token_mode()
        ray.init(address="local", **init_kwargs)
        return
    given = address or os.environ.get("RAY_ADDRESS")
    where = (f"{given} (RAY_ADDRESS)" if not address and given else given or resolved)
    if not resolved.startswith("ray://"):  # Ray Client addresses authenticate through their own server
        _check_auth(resolved, where)
    try:
        ray.init(address=resolved, **init_kwargs)
    except ConnectionError as e:
        raise RayConnectError(f"could not join the Ray cluster at {where}: {e}") from None
