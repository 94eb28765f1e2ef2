"""A run's card on its fleet: one small Serve application per attached run, `fleet-NAME.run.RUN`, routed at
`/runs/RUN` (docs/FLEET.md, "Seeing the runs").

The Ray dashboard's Serve view lists applications, not the state inside one, so a fleet's runs would be invisible
there; an application per run makes each one a row of that view (its status, its route) for exactly as long as
the run holds a lease. FleetState deploys it when the run attaches and deletes it when the run leaves (detached,
lease expired), in the background: a card never delays an attach or a forget, and a card that fails to deploy
costs the run nothing but its row.

`GET /runs/RUN` answers the run's own view of `fleet status`: its slots, rank, weight, lease left, tokens
generated and share, and the versions live on the fleet (`RUN/policy-vN`). It reads like `/v1/models`: the
fleet's read token when one is set (the admin token and any run's token read too). The replica holds no CPU
(num_cpus 0) and imports no engine code.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from ray import serve

from common.names import NAMESPACE, fleet_app
from common.types import adapter_name, latest_name
from serve_deployments.admin import bearer
from serve_deployments.engine_config import SHUTDOWN_POLL_S
from serve_deployments.openai_body import error_body, json_response
from serve_deployments.served_versions import UnknownRunError

RUN_INFIX = ".run."


def run_card_app(fleet: str, run: str) -> str:
    return f"{fleet_app(fleet)}{RUN_INFIX}{run}"


def run_card_route(run: str) -> str:
    return f"/runs/{run}"


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=16,
                  health_check_period_s=30, graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
class RunCard:
    def __init__(self, fleet: str, run: str):
        import ray

        self.fleet, self.run = fleet, run
        # The card lives no longer than FleetState (it deletes the card, and `fleet down` both): one lookup.
        self._state = ray.get_actor(fleet_app(fleet), namespace=NAMESPACE)

    async def card(self) -> dict | None:
        """The run's state on the fleet, or None once the fleet forgot it."""
        r = (await self._state.runs.remote()).get(self.run)
        if r is None:
            return None
        ingress = serve.get_app_handle(fleet_app(self.fleet))
        fair = (await ingress.fleet_stats.remote()).get("runs", {}).get(self.run, {})
        try:
            live = sorted(await ingress.live_versions.remote(self.run))
        except UnknownRunError:  # forgotten between the two questions
            return None
        models = [adapter_name(v, self.run) for v in live] + ([latest_name(self.run)] if live else [])
        return {"run": self.run, "fleet": self.fleet, "slots": r["slots"], "lora_rank": r["lora_rank"],
                "weight": r["weight"], "lease_left_s": r["lease_left_s"], "attached_at": r["attached_at"],
                "tokens": fair.get("tokens", 0), "share": fair.get("share", 0.0), "queued": fair.get("queued", 0),
                "live_versions": live, "models": models}

    async def __call__(self, request: Request) -> Response:
        if request.method != "GET" or request.url.path.rstrip("/") != run_card_route(self.run):
            return json_response(error_body(404, f"only GET {run_card_route(self.run)} is served here"), 404)
        if not await self._state.check_read.remote(bearer(request)):
            return json_response(error_body(401, "reading this fleet needs 'Authorization: Bearer <read token>'",
                                            "authentication_error"), 401)
        card = await self.card()
        if card is None:
            return json_response(error_body(404, f"run {self.run} is no longer attached to fleet {self.fleet}"), 404)
        return json_response(card)


def deploy_run_card(fleet: str, run: str) -> None:
    """Blocking (FleetState runs it in a thread): deploy the card and wait until Serve says it runs."""
    serve.run(RunCard.options(name="card").bind(fleet, run), name=run_card_app(fleet, run),
              route_prefix=run_card_route(run))


def delete_run_card(fleet: str, run: str) -> None:
    serve.delete(run_card_app(fleet, run), _blocking=False)


def delete_all_run_cards(fleet: str) -> list[str]:
    """`fleet down`: every card of the fleet, whatever FleetState remembers."""
    prefix = fleet_app(fleet) + RUN_INFIX
    gone = [name for name in serve.status().applications if name.startswith(prefix)]
    for name in gone:
        serve.delete(name, _blocking=False)
    return gone
