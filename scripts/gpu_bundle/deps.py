"""Which packages go into the GPU bundle: the project's requirements, the resolved dependency graph, and
what the target already has.

A package is left out when
- the target has it (`--target-has NAME`, or a `--target-freeze` line whose version satisfies every
  requirement the bundle's packages put on it), or it is excluded (`--exclude`);
- or only such packages need it (torch's CUDA libraries, an excluded package's own dependencies).
A package the target has at a version that fails a requirement is bundled (it comes first on
PYTHONPATH), unless the bundled version itself needs a different version of a `--target-has` package:
then the target's copy stays and the conflict is reported (vLLM pins numba, whose pin on numpy would
not accept the target's numpy).
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(pyproject: Path, extras: Iterable[str] = ("gpu",)) -> list[Requirement]:
    """The base dependencies and the given optional-dependency groups of pyproject.toml."""
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def read_pins(path: Path) -> dict[str, str]:
    """`name==version` lines (a requirements lock or a `pip list --format=freeze`); comments skipped."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"{path}: not a name==version line: {line!r}")
        pins[normalize(name.strip())] = version.strip()
    return pins


def public_version(version: str) -> str:
    """2.11.0+cu130 -> 2.11.0: PyPI metadata carries no local build tag."""
    return version.split("+", 1)[0]


def target_environment(python: str, machine: str = "x86_64") -> dict[str, str]:
    """The marker environment of a Linux CPython target."""
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "implementation_version": f"{python}.0",
            "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": machine,
            "platform_release": "", "platform_version": ""}


@dataclass
class Package:
    name: str  # normalized
    version: str
    requires: list[Requirement] = field(default_factory=list)


def packages_from_report(report: dict) -> dict[str, Package]:
    """The packages of a `pip install --dry-run --report` JSON report."""
    packages = {}
    for item in report["install"]:
        meta = item["metadata"]
        name = normalize(meta["name"])
        packages[name] = Package(name, meta["version"], [Requirement(r) for r in meta.get("requires_dist", [])])
    return packages


@dataclass
class Selection:
    bundle: dict[str, str]  # name -> version
    left_out: dict[str, str]  # name -> why
    warnings: list[str]


class _Graph:
    def __init__(self, packages: dict[str, Package], roots: list[Requirement], env: dict[str, str]):
        self.packages, self.env, self.roots = packages, env, roots
        self.extras: dict[str, set[str]] = self._extras_wanted_by(())

    def _extras_wanted_by(self, names: Iterable[str]) -> dict[str, set[str]]:
        """The extras the roots and the given packages ask of each package. Only these count: an extra that
        only a package left out asks for (cuda-toolkit[nvcc] of an excluded kernel library) pulls nothing in."""
        extras: dict[str, set[str]] = defaultdict(set)
        for req in self.roots:
            extras[normalize(req.name)] |= req.extras
        for name in names:
            for req in self.packages[name].requires:
                if self.applies(name, req):
                    extras[normalize(req.name)] |= req.extras
        return extras

    def applies(self, owner: str | None, req: Requirement) -> bool:
        if req.marker is None:
            return True
        extras = {""} | (self.extras.get(owner, set()) if owner else set())
        return any(req.marker.evaluate({**self.env, "extra": extra}) for extra in extras)

    def edges(self, name: str) -> list[tuple[str, Requirement]]:
        return [(normalize(r.name), r) for r in self.packages[name].requires
                if normalize(r.name) in self.packages and self.applies(name, r)]

    def reach(self, start: Iterable[str], stop: set[str]) -> set[str]:
        """What `start` needs, not passing through `stop`; extras as asked by what is reached (a fixpoint)."""
        start = list(start)
        self.extras = self._extras_wanted_by(())
        while True:
            seen = self._walk(start, stop)
            extras = self._extras_wanted_by(seen)
            if _nonempty(extras) == _nonempty(self.extras):
                return seen
            self.extras = extras

    def _walk(self, start: list[str], stop: set[str]) -> set[str]:
        seen: set[str] = set()
        todo = [n for n in start if n in self.packages and n not in stop]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo += [dep for dep, _ in self.edges(name) if dep not in stop and dep not in seen]
        return seen


def _nonempty(extras: dict[str, set[str]]) -> dict[str, set[str]]:
    return {name: wanted for name, wanted in extras.items() if wanted}


def select(packages: dict[str, Package], roots: list[Requirement], *, target_has: set[str], exclude: set[str],
           freeze: dict[str, str], env: dict[str, str]) -> Selection:
    """Split a resolved graph into what the bundle carries and what it leaves out (see the module doc)."""
    graph = _Graph(packages, roots, env)
    root_names = [normalize(r.name) for r in roots if graph.applies(None, r)]
    target_has, exclude = {normalize(n) for n in target_has}, {normalize(n) for n in exclude}
    freeze = {normalize(n): v for n, v in freeze.items()}
    on_target = {n for n in freeze if n in packages and n not in target_has}  # the target's copy is used
    pinned_by_conflict: dict[str, str] = {}  # bundling these would break a --target-has package
    while True:
        bundle = graph.reach(root_names, target_has | on_target | set(pinned_by_conflict) | exclude)
        wants = _wants(graph, roots, bundle)
        unmet = {n for n in on_target if not all(s.contains(freeze[n], prereleases=True) for _, s in wants[n])}
        if unmet:
            on_target -= unmet
            continue
        conflicts = {name: why for name in sorted(bundle & set(freeze)) if (why := _conflict(graph, name, target_has,
                                                                                            freeze))}
        if not conflicts:
            break
        pinned_by_conflict.update(conflicts)
    warnings = [f"{why}: keeping the target's {name} {freeze[name]}" for name, why in pinned_by_conflict.items()]
    for name in sorted(bundle):
        if name in freeze:
            unmet_by = [f"{who} {spec}" for who, spec in wants[name]
                        if not spec.contains(freeze[name], prereleases=True)]
            warnings.append(f"bundling {name} {packages[name].version} over the target's {freeze[name]} "
                            f"(wanted by {', '.join(unmet_by)})")
        elif why := _conflict(graph, name, target_has, freeze):
            warnings.append(why)
    left_out = {}
    for name in sorted(set(packages) - bundle):
        if name in target_has:
            left_out[name] = "on the target (--target-has)"
        elif name in on_target:
            left_out[name] = f"on the target ({freeze[name]})"
        elif name in pinned_by_conflict:
            left_out[name] = f"on the target ({freeze[name]}, see the warnings)"
        elif name in exclude:
            left_out[name] = "excluded (--exclude)"
        else:
            left_out[name] = "needed only by packages left out"
    return Selection({n: packages[n].version for n in sorted(bundle)}, left_out, warnings)


def _wants(graph: _Graph, roots: list[Requirement], bundle: set[str]) -> dict[str, list[tuple[str, SpecifierSet]]]:
    """name -> (who, specifier) for every requirement the project and the bundled packages put on it."""
    wants: dict[str, list[tuple[str, SpecifierSet]]] = defaultdict(list)
    for req in roots:
        wants[normalize(req.name)].append(("the project", req.specifier))
    for name in bundle:
        for dep, req in graph.edges(name):
            wants[dep].append((name, req.specifier))
    return wants


def _conflict(graph: _Graph, name: str, target_has: set[str], freeze: dict[str, str]) -> str | None:
    """Why the resolved `name` cannot work beside a --target-has package at the target's version, if so."""
    for dep, req in graph.edges(name):
        if dep in target_has and dep in freeze and not req.specifier.contains(freeze[dep], prereleases=True):
            return f"{name} {graph.packages[name].version} needs {req}, the target has {dep} {freeze[dep]}"
    return None


def uncovered(pins: dict[str, str], requirements: list[Requirement], provided: set[str],
              env: dict[str, str] | None = None) -> list[str]:
    """Requirements that neither a pin nor the target (`provided` names) meets: why a lock is stale."""
    problems = []
    provided = {normalize(n) for n in provided}
    for req in requirements:
        name = normalize(req.name)
        if req.marker is not None and env is not None and not req.marker.evaluate(env):
            continue
        if name in provided:
            continue
        if name not in pins:
            problems.append(f"{req}: not in the bundle and not declared on the target")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{req}: the bundle pins {name}=={pins[name]}")
    return problems
