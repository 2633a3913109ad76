"""Resolve, part of: the GPU roles the stages hold, the GPUs each role gets, and each stage's.

Input: the loaded pipeline, the GPU count it is resolved for (`cluster.gpus`, or what `auto`
came to) and its colocation. Output: `{role: RoleAlloc}` (split by `engine.resolve.resources`)
and, per stage, its GPU count: `resources.gpus`, or its role's GPUs, or the GPUs of the
roles its kind holds (colocated roles counted once). Problems go to the resolution's errors
and notes: a role of the ratio no stage uses, a role that got no GPUs, a refused role.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import Diagnostic, did_you_mean
from engine.load.load import LoadedPipeline, stage_config_data
from engine.load.source import render_path
from engine.resolve.resources import allocate, ratio_text, refused_roles
from engine.stage import RoleAlloc, kinds


@dataclass
class Roles:
    """The roles of one resolution and what each got; problems go to `errors` and `notes`."""

    loaded: LoadedPipeline
    errors: list[Diagnostic]
    notes: list[Diagnostic]
    cpu_only: bool = False  # `cluster.gpus: auto` came to 0
    alloc: dict[str, RoleAlloc] = field(default_factory=dict)
    alloc_failed: bool = False
    refused: set[str] = field(default_factory=set)  # stages whose role is refused
    wanting: set[str] = field(default_factory=set)  # stages whose GPU requests that dropped

    def allocate(self, total: Any, colocate: Any) -> dict[str, RoleAlloc]:
        """Split `total` GPUs (none while unknown) among the used roles by the ratio."""
        spec = self.loaded.spec
        used = self.used()
        self.refused = refused_roles(self.loaded.doc, spec, used, self.errors)
        if isinstance(total, int) and used:
            where = self.loaded.doc.value_loc(("cluster", "gpus"))
            ratio = self.ratio(used)
            self.alloc, errs = allocate(total, ratio, colocate, where, ratio_text(ratio), used)
            self.errors.extend(errs)
            self.alloc_failed = bool(errs)
        return self.alloc

    def used(self) -> frozenset[str]:
        """Roles some stage holds: its `resources.role`, or those its kind says it uses."""
        used: set[str] = set()
        for name, st in self.loaded.spec.stages.items():
            if st.resources.role:
                used.add(st.resources.role)
            used.update(self.kind_roles(name))
        return frozenset(used)

    def kind_roles(self, name: str) -> tuple[str, ...]:
        """The roles a stage's kind says it holds (an online-RL stage's engines, actor, ...)."""
        spec = self.loaded.spec
        kind = kinds().get(spec.stages[name].kind)
        if kind is None:
            return ()
        return kind.config.roles_used(stage_config_data(spec, name, kind))

    def ratio(self, used: frozenset[str]) -> dict[str, int]:
        """The written ratio over the used roles (a role no stage uses is dropped, with a
        warning), or 1 for every used role when none is written."""
        doc = self.loaded.doc
        raw = doc.data.get("resources")
        if not (isinstance(raw, dict) and "ratio" in raw):
            return {r: 1 for r in used}
        ratio = {str(r): n for r, n in self.loaded.spec.resources.ratio.items()}
        for role in ratio:
            if role not in used:
                self.notes.append(
                    Diagnostic(
                        doc.key_loc(("resources", "ratio", role)),
                        f"resources.ratio.{role}",
                        f"no stage uses role '{role}'; it gets no GPUs",
                        "warning",
                    )
                )
        return {r: n for r, n in ratio.items() if r in used}

    def stage_gpus(self, name: str) -> int:
        """The GPUs stage `name` holds (0 on the CPU, or where its role got none)."""
        res = self.loaded.spec.stages[name].resources
        if self.cpu_only and (res.gpus or res.role or self.kind_roles(name)):
            self.wanting.add(name)  # `cluster.gpus: auto` came to 0: on the CPU
            return 0
        if res.gpus is not None:
            return res.gpus
        if res.role is None:
            held = self.kind_roles(name)
            pools = {(r, *sorted(self.alloc[r].colocated_with)) for r in held if r in self.alloc}
            return sum(self.alloc[pool[0]].gpus for pool in {tuple(sorted(p)) for p in pools})
        if res.role in self.alloc:
            return self.alloc[res.role].gpus
        if self.alloc_failed or name in self.refused:
            return 0
        if isinstance(self.loaded.spec.cluster.gpus, int) and self.loaded.spec.cluster.gpus == 0:
            return 0
        self._no_gpus(name, res.role)
        return 0

    def _no_gpus(self, name: str, role: str) -> None:
        path = ("stages", name, "resources", "role")
        self.errors.append(
            Diagnostic(
                self.loaded.doc.value_loc(path),
                render_path(path),
                f"role '{role}' has no GPUs: it is not in resources.ratio"
                f"{did_you_mean(role, sorted(self.alloc))}",
            )
        )
