"""One way to run steps, for the daemon's passes and for `gpuguard check`.

A pass runs the steps it was marked for in the registry's order, each timed, its share
of the pass's findings, outcomes and gauges recorded, a crash journaled and contained
(the next pass tries again: never the loop down); then what the steps asked for next
(`PassContext.recheck`, `announce`) resolved to step names through the registry.
`gpuguard check` runs the same steps through the same runner, once, with the daemon's
immediate follow-up (`run_once`).

Free of D-Bus and asyncio imports, like passes.py: `gpuguard check` imports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, Sequence

from gpuguard.steps.registry import WAKES, Wakes, check_names, woken_by

if TYPE_CHECKING:
    from gpuguard.engine.passes import PassContext, Services
    from gpuguard.model import Finding, Outcome
    from gpuguard.steps.registry import Step

# (delay seconds, steps, why): a follow-up resolved to step names (the daemon's timers)
Due = tuple[float, frozenset[str], str]


@dataclass(frozen=True)
class StepResult:
    """What one step added to a pass (the ledger's and `gpuguard check`'s unit)."""

    name: str
    findings: tuple[Finding, ...]
    outcomes: tuple[Outcome, ...]
    error: Optional[str] = None  # "Type: message" of a crash the runner contained
    ms: float = 0.0
    gauges: Mapping[str, float] = field(default_factory=dict)
    unknown: tuple[str, ...] = ()  # what the step could not see (PassContext.unknown)


class PassRunner:
    """The steps of a daemon or a `gpuguard check`, in `order` (the registry's)."""

    def __init__(
        self,
        steps: Mapping[str, Step],
        order: Sequence[str],
        *,
        wakes: Wakes = WAKES,
        propagate: tuple[type[BaseException], ...] = (),
    ) -> None:
        check_names(steps, order, "PassRunner(steps=...)")
        self.order = tuple(order)
        self.steps = {name: steps[name] for name in self.order if name in steps}
        self.wakes = wakes
        # Errors a step raises on purpose to end the run (`gpuguard check`'s exit codes);
        # any other exception is a crash, journaled and recorded for that step.
        self.propagate = propagate

    async def run(self, svc: Services, ctx: PassContext, names: Iterable[str]) -> list[StepResult]:
        """The steps of `names` that this runner has, in its order."""
        marked = frozenset(names)
        results = []
        for name, step in self.steps.items():  # in order: it matters
            if name not in marked:
                continue
            t0 = time.monotonic()
            n_findings, n_outcomes, error = len(ctx.findings), len(ctx.outcomes), None
            n_unknown = len(ctx.unknown)
            gauges_before = set(ctx.gauges)
            ctx.step = name
            try:
                await step(svc, ctx)
            except self.propagate:
                raise
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                svc.log.crashed(name, f"reconciler {name}", e)
            finally:
                ctx.step = ""
            results.append(
                StepResult(
                    name,
                    tuple(ctx.findings[n_findings:]),
                    tuple(ctx.outcomes[n_outcomes:]),
                    error,
                    round((time.monotonic() - t0) * 1000, 2),
                    {k: v for k, v in ctx.gauges.items() if k not in gauges_before},
                    tuple(ctx.unknown[n_unknown:]),
                )
            )
        return results

    def due(self, ctx: PassContext) -> list[Due]:
        """The pass's follow-ups as step names: a recheck names its own step, an event
        the steps the registry wakes on it (among this runner's)."""
        out = []
        for f in ctx.followups:
            if f.event is not None:
                names = woken_by(f.event, frozenset(self.steps), self.wakes)
            else:
                names = frozenset({f.step}) & frozenset(self.steps)
            if names:
                out.append((f.delay, names, f.why))
        return out

    async def run_once(
        self, svc: Services, ctx: PassContext, names: Iterable[str], *, follow_up: bool
    ) -> list[StepResult]:
        """`gpuguard check`: `names` once, then (`follow_up`) the daemon's immediate
        follow-up pass once, for the steps among `names` that one of them asked for at
        once (the /dev/char links just made: durable grants now). Its results are the
        second run's news only: a finding the first run made is not repeated, and in a
        dry-run a change the first run planned is not planned twice."""
        marked = frozenset(names)
        results = await self.run(svc, ctx, marked)
        again = frozenset(n for delay, due, _ in self.due(ctx) if delay == 0 for n in due)
        if not follow_up or not again & marked:
            return results
        seen = [f for r in results for f in r.findings]
        planned = {o.action for r in results for o in r.outcomes}
        for r in await self.run(svc, ctx, again & marked):
            findings = tuple(f for f in r.findings if f not in seen)
            fresh = tuple(o for o in r.outcomes if o.action not in planned)
            outcomes = svc.apply.pick(made=r.outcomes, described=fresh)
            results.append(
                StepResult(r.name, findings, outcomes, r.error, r.ms, r.gauges, r.unknown)
            )
        return results
