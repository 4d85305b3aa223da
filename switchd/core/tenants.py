"""Tenants' shares of a switch: what each uses, checked against its quota.

The topology gives each tenant its quotas (slots, slot memory); the job
service asks :meth:`TenantLedger.over_quota` before it grants a job, charges
the job when granted and uncharges it on release. A refusal names the tenant,
the switch and the quota.
"""

from __future__ import annotations

from fabric.core.topology import Topology
from kernels.dtypes import DTYPES
from switchd.core.events import JobSpec

__all__ = ["TenantLedger", "slot_bytes"]


def slot_bytes(spec: JobSpec) -> int:
    """Slot memory a job reserves (the engine's formula: 2 versions per slot)."""
    return 0 if spec.referenced else spec.slots * 2 * spec.slot_elems * DTYPES[spec.dtype].itemsize


def _no_use() -> dict[str, int]:
    return {"jobs": 0, "slots": 0, "memory_bytes": 0, "refused": 0}


class TenantLedger:
    """Per tenant at one switch: jobs, slots and slot memory in use, refusals."""

    def __init__(self, topo: Topology, switch: str) -> None:
        self.topo = topo
        self.switch = switch
        self.use: dict[str, dict[str, int]] = {}
        self._share: dict[int, tuple[str, int, int]] = {}

    def over_quota(self, spec: JobSpec, members: tuple[int, ...]) -> str | None:
        """Why the members' tenant may not have this job here, or None."""
        tenants = sorted({self.topo.tenant_of(m) for m in members})
        if len(tenants) > 1:
            return f"a job's members must share one tenant, not {', '.join(tenants)}"
        tenant = tenants[0]
        if spec.job in self._share:
            return None  # registered already: an idempotent retry
        quota = self.topo.tenants.get(tenant)
        if quota is None:
            return None
        use = self.use.get(tenant, {})
        slots = use.get("slots", 0) + spec.slots
        nbytes = use.get("memory_bytes", 0) + slot_bytes(spec)
        why = None
        if quota.slots is not None and slots > quota.slots:
            why = f"{slots} slots > its quota of {quota.slots}"
        elif quota.memory_bytes is not None and nbytes > quota.memory_bytes:
            why = f"{nbytes} B of slot memory > its quota of {quota.memory_bytes} B"
        if why is None:
            return None
        u = self.use.setdefault(tenant, _no_use())
        u["refused"] += 1
        return f"tenant {tenant!r} at {self.switch}: {why}"

    def charge(self, spec: JobSpec, members: tuple[int, ...]) -> None:
        """A job was granted: count its share (once per job)."""
        if spec.job in self._share:
            return
        tenant = self.topo.tenant_of(members[0])
        share = (tenant, spec.slots, slot_bytes(spec))
        self._share[spec.job] = share
        u = self.use.setdefault(tenant, _no_use())
        u["jobs"] += 1
        u["slots"] += share[1]
        u["memory_bytes"] += share[2]

    def uncharge(self, job: int) -> None:
        """A job ended: give its share back."""
        share = self._share.pop(job, None)
        if share is not None:
            u = self.use[share[0]]
            u["jobs"] -= 1
            u["slots"] -= share[1]
            u["memory_bytes"] -= share[2]

    def statistics(self) -> dict[str, dict[str, int]]:
        """A copy of every tenant's use here."""
        return {t: dict(u) for t, u in self.use.items()}
