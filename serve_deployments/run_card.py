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

import logging

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from common.names import NAMESPACE, fleet_app
from common.types import adapter_name, latest_name
from serve_deployments.served_versions import UnknownRunError

logger = logging.getLogger("ray.serve")

RUN_INFIX = ".run."


def run_card_app(fleet: str, run: str) -> str:
    return f"{fleet_app(fleet)}{RUN_INFIX}{run}"


def run_card_route(run: str) -> str:
    return f"/runs/{run}"


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=16,
                  health_check_period_s=30)
class RunCard:
    def __init__(self, fleet: str, run: str):
        self.fleet, self.run = fleet, run

    async def card(self) -> dict | None:
        """The run's state on the fleet, or None once the fleet forgot it."""
        import ray

        state = ray.get_actor(fleet_app(self.fleet), namespace=NAMESPACE)
        r = (await state.runs.remote()).get(self.run)
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

    async def __call__(self, request: Request) -> JSONResponse:
        import ray

        if request.method != "GET" or request.url.path.rstrip("/") != run_card_route(self.run):
            return JSONResponse({"error": f"only GET {run_card_route(self.run)} is served here"}, status_code=404)
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        state = ray.get_actor(fleet_app(self.fleet), namespace=NAMESPACE)
        if not await state.check_read.remote(token):
            return JSONResponse({"error": f"fleet {self.fleet}: reading needs the fleet's read token"},
                                status_code=401)
        card = await self.card()
        if card is None:
            return JSONResponse({"error": f"run {self.run} is no longer attached to fleet {self.fleet}"},
                                status_code=404)
        return JSONResponse(card)


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
