"""Which versions the ingress offers, and what each one is.

The AdapterRegistry owns which versions are live: it marks one live only after the ingress's
`load_adapter` returned, i.e. after every replica acknowledged. The ingress only withholds versions an
operator unloaded (`unloaded`), and knows which version the base weights are (`merged_version`: 0, or N
after merge mode swapped in policy-vN's merged weights). See docs/ARCHITECTURE.md, "Versions and staleness".
"""
from __future__ import annotations

from collections.abc import Callable

from ray.actor import ActorHandle

from common.faults import LostError, short_error
from common.types import adapter_name


class RegistryGoneError(LostError):
    """The standalone run's registry cannot be reached, so no request can be resolved to a version: the
    driver that owns it ended (a registry dies with its owner's last handle) or it is being restarted.
    The OpenAI routes answer it with 503 (openai_body.install_error_handlers); for a Ray caller it is a lost
    callee (common.faults.is_lost), as the registry's own ActorDiedError was, also once pickled."""


class ServedVersions:
    """The ingress's view of the registry. `lookup()` finds the AdapterRegistry actor (called once, when
    first needed: the registry may start after the ingress)."""

    def __init__(self, lookup: Callable[[], ActorHandle | None], run: str = ""):
        self._lookup = lookup
        self.run = run
        self._registry: ActorHandle | None = None
        self.unloaded: set[int] = set()  # versions an operator unloaded: not offered until loaded again
        self.merged_version = 0  # merge mode: the base weights now are this version's
        self._sha: dict[int, str | None] = {}  # version -> the registry's digest of it

    def registry(self) -> ActorHandle | None:
        """The run's registry; None for a fleet's run "" (the base model only)."""
        if self._registry is None:
            self._registry = self._lookup()
        return self._registry

    def name(self, version: int) -> str:
        return adapter_name(version, self.run)

    async def live(self) -> list[int]:
        """Versions new requests may use, oldest first. A fleet run whose registry is not (or no longer) there
        offers none: its driver is starting or gone, and its lease decides when it leaves the fleet."""
        try:
            registry = self.registry()
            if registry is None:
                return []
            live = await registry.live_versions.remote()
        except Exception as e:
            self._registry = None  # looked up again next time: a restarted driver makes a new one
            if not self.run:
                raise RegistryGoneError(f"the adapter registry cannot be reached ({short_error(e)}): no policy "
                                        "version can be resolved; the run that publishes them ended or is "
                                        "restarting") from e
            return []
        return sorted(v for v in live if v not in self.unloaded)

    async def entry(self, version: int) -> dict:
        """The registry's `{"ref": [ObjectRef], "meta": dict}` of a version; raises when it does not hold it."""
        registry = self.registry()
        if registry is None:
            raise KeyError(f"{self.name(version)}: no registry")
        return await registry.get.remote(version)

    async def sha(self, version: int) -> str | None:
        """The registry's sha256 of a version (None for the original base model), cached."""
        if version <= 0:
            return None
        if version not in self._sha:
            try:
                self._sha[version] = (await self.entry(version))["meta"].get("sha256")
            except Exception:
                return None  # trimmed from the registry: nothing to compare with
        return self._sha[version]


class UnknownRunError(KeyError):
    """A run name no run attached to this fleet has."""

    def __init__(self, run: str):
        super().__init__(run)
        self.run = run
        self.message = f"run {run!r} is not attached to this fleet"

    def __str__(self) -> str:
        return self.message


class RunVersions:
    """Every run's ServedVersions on one ingress: the standalone run "" (a service of its own, or a fleet's
    base model) and, on a fleet, each attached run. `lookup(run)` finds a run's AdapterRegistry."""

    def __init__(self, lookup: Callable[[str], ActorHandle | None]):
        self._lookup = lookup
        self._runs: dict[str, ServedVersions] = {"": ServedVersions(lambda: lookup(""))}

    @classmethod
    def of(cls, versions: RunVersions | ServedVersions) -> RunVersions:
        """`versions` as a RunVersions: one ServedVersions is a standalone service's run ""."""
        if isinstance(versions, RunVersions):
            return versions
        runs = cls(lambda run: None)
        runs._runs[""] = versions
        return runs

    def get(self, run: str = "") -> ServedVersions:
        try:
            return self._runs[run]
        except KeyError:
            raise UnknownRunError(run) from None

    def add(self, run: str) -> ServedVersions:
        if run not in self._runs:
            self._runs[run] = ServedVersions(lambda: self._lookup(run), run)
        return self._runs[run]

    def drop(self, run: str) -> None:
        if run:
            self._runs.pop(run, None)

    def runs(self) -> list[str]:
        return sorted(self._runs)

    async def live_all(self) -> dict[str, list[int]]:
        """Every run's live versions. Each run's registry is awaited in turn: a run that left the fleet
        meanwhile is left out (CI once saw `UnknownRunError: run 'b'` here, a 500 to the client)."""
        out = {}
        for run in self.runs():
            versions = self._runs.get(run)
            if versions is not None:
                out[run] = await versions.live()
        return out

    @property
    def base(self) -> ServedVersions:
        return self._runs[""]
