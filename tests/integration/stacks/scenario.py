"""The F2 scenario on one booted release, with runc and crun containers side by side.

1. Exposure, gpuguard stopped: each disruptive event once (a daemon-reload, a
   daemon-reexec, the runtime's update of every container, a ``DeviceAllow=`` reset of
   every scope over the bus); after each, which containers the kernel now denies their
   GPU (re-granted by the hook's way before the next). This is what the release does
   on its own: docs/devices.md's table of what each systemd version does at a reload.
2. gpuguard running: the same events, ``ROUNDS`` times; after each, once gpuguard's
   passes have gone quiet, every container's GPU must open (a loss otherwise) and the
   GPU it was not given must not (an over-grant otherwise).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from integration.gpuguard_ns import passes, settle
from integration.pkgroot import PackageRoot, built_packages, debian_root, source_version
from integration.stacks.node import Ctr, Node, StackError, copy_debs, make_ctrs, prepare_host_dir

RUNTIMES = ("runc", "crun")
PER_RUNTIME = 3  # containers of each runtime
ROUNDS = 2
QUIET_WITHIN = 20.0  # seconds for gpuguard's passes to go quiet after an event
EVENTS = ("daemon-reload", "daemon-reexec", "runtime-update", "device-allow-reset")
MOVED = (
    "{} process(es) left by systemd in their pod slice's v1 devices cgroup at start,"
    " moved into their scope"
)
#: Runtimes that cannot make a container on these machines, and why (their cells are
#: reported as not run, with the runtime's own error; any other failure fails).
CANNOT_START: Dict[Tuple[str, str], Dict[str, str]] = {
    (suite, "v2"): {
        "crun": f"crun {version} needs CAP_SYS_RESOURCE: it raises RLIMIT_MEMLOCK to load"
        " its device program, and these test machines' bounding set lacks that capability",
    }
    for suite, version in (("bullseye", "0.17"), ("bookworm", "1.8.1"))
}


@dataclass
class Cell:
    """One (release, layout, runtime) cell's outcome, as the matrix shows it."""

    suite: str
    layout: str
    runtime: str
    versions: Dict[str, str]
    install: str
    placement: List[str]  # where each container's process is, relative to its scope
    exposure: Dict[str, int]  # event -> containers that lost their GPU without gpuguard
    containers: int = 0
    found: int = 0  # of them, listed by `gpuguard status`
    events: int = 0
    losses: int = 0
    over_grants: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.found == self.containers
            and not self.losses
            and not self.over_grants
            and not any("did not go quiet" in n for n in self.notes)
        )

    def write(self, directory: Path, test: str, known: str = "") -> Path:
        """``known``: why this cell is expected to fail today (its xfail reason)."""
        directory.mkdir(parents=True, exist_ok=True)
        out = directory / f"{self.suite}-{self.layout}-{self.runtime}.json"
        doc = {**asdict(self), "result": "pass" if self.ok else "fail", "test": test}
        doc["known"] = known
        out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        return out


def install_gpuguard(node: Node, suite: str) -> str:
    """The .deb; where its dependencies do not resolve (bullseye: no python3-dbus-next),
    the .deb built with dbus-next bundled, and the returned text says so."""
    plain = f"/run/host/debs/gpuguard_{source_version()}-1_all.deb"
    rc, out = node.apt_install(plain)
    if rc == 0:
        return ".deb"
    if "python3-dbus-next" not in out:
        raise StackError(f"apt-get install {plain} failed ({rc}):\n{out[-3000:]}")
    bundled = f"/run/host/debs/bundled/gpuguard_{source_version()}-1_all.deb"
    rc, out = node.apt_install(bundled)
    if rc != 0:
        raise StackError(f"apt-get install {bundled} failed ({rc}):\n{out[-3000:]}")
    return f".deb --bundle-dbus-next (no python3-dbus-next in {suite})"


def found_by_gpuguard(node: Node) -> List[str]:
    res = node.ns.run(["gpuguard", "status", "--json"], timeout=60)
    try:
        rows = json.loads(res.stdout)["containers"]
    except (ValueError, KeyError) as e:
        raise StackError(f"gpuguard status --json: {e}\n{res.stdout}\n{res.stderr}") from e
    return [str(r["container_id"]) for r in rows]


class Stack:
    """Boots ``suite`` on ``layout``, runs the scenario, keeps each runtime's Cell."""

    def __init__(self, suite: str, layout: str, tmp: Path) -> None:
        self.suite, self.layout, self.tmp = suite, layout, tmp
        self.cells: Dict[str, Cell] = {}
        self.seconds: Dict[str, float] = {}
        self.not_run: Dict[str, str] = {}  # runtime -> why its containers could not start
        self.versions: Dict[str, str] = {}
        self.install = ""
        self.cannot_start = CANNOT_START.get((suite, layout), {})

    def run(self) -> None:
        t0 = time.monotonic()
        lower, made = debian_root(self.suite)
        if made is not None:
            self.seconds["debootstrap"] = made
        debs = copy_debs(self.tmp / "debs", built_packages()["deb"])
        copy_debs(debs / "bundled", built_packages(variant="bundled")["deb"])
        ns = PackageRoot(
            self.tmp / "root",
            lower,
            suite=self.suite,
            layout=self.layout,
            binds=prepare_host_dir(self.tmp),
            ro_binds={"/run/host/debs": debs},
        )
        ns.start()
        try:
            self._scenario(Node(ns, self.tmp))
        except AssertionError as e:
            tail = ns.run(["journalctl", "--no-pager", "-u", "gpuguard", "-n", "60"]).stdout
            raise StackError(f"{e}\n--- gpuguard's journal, last entries:\n{tail}") from e
        finally:
            ns.stop()
        self.seconds["total"] = time.monotonic() - t0

    def _scenario(self, node: Node) -> None:
        ns = node.ns
        versions = self.versions = node.versions()
        node.prepare()
        install = self.install = install_gpuguard(node, self.suite)
        ns.wait_active("gpuguard.service", timeout=30)
        ns.systemctl("stop", "gpuguard.service")
        node.start_containerd()
        by_rt: Dict[str, List[Ctr]] = {}
        for rt in RUNTIMES:
            try:
                for c in make_ctrs(rt, PER_RUNTIME, f"{self.suite}-{self.layout}"):
                    node.run(c)
                    node.hook_grant(c)
                    by_rt.setdefault(rt, []).append(c)
            except StackError as e:
                if rt not in self.cannot_start:
                    raise
                self.not_run[rt] = f"{self.cannot_start[rt]}: {str(e).splitlines()[-1][-200:]}"
                by_rt.pop(rt, None)
        everyone = [c for cs in by_rt.values() for c in cs]
        bad = node.lacking(everyone) + node.over_granted(everyone)
        if bad:
            raise StackError(f"the hook's grant did not take: {[c.unit for c in bad]}")
        for rt, cs in by_rt.items():
            moved = sum(m.startswith(rt) for m in node.moved)
            self.cells[rt] = Cell(
                self.suite,
                self.layout,
                rt,
                {**versions, "runtime": versions[rt]},
                install,
                sorted({node.placement(c) for c in cs}),
                {},
                containers=len(cs),
                notes=[MOVED.format(moved)] if moved else [],
            )
        # 1. what the release does on its own
        for event in EVENTS:
            notes = self._apply(node, event, everyone)
            for rt, cs in by_rt.items():
                lost = self._settled_losses(node, cs)
                self.cells[rt].exposure[event] = len(lost)
                self.cells[rt].notes += [n for n in notes if n.startswith(rt)]
                for c in lost:
                    node.hook_grant(c)
        # 2. with gpuguard
        ns.systemctl("start", "gpuguard.service")
        settle(ns, timeout=60)
        for _ in range(ROUNDS):
            for event in EVENTS:
                self._apply(node, event, everyone)
                before = passes(ns)
                try:
                    settle(ns, timeout=QUIET_WITHIN)
                except AssertionError:
                    note = (
                        f"after a {event}, gpuguard's passes did not go quiet within "
                        f"{QUIET_WITHIN:.0f} s ({passes(ns) - before} passes)"
                    )
                    for cell in self.cells.values():
                        if note not in cell.notes:
                            cell.notes.append(note)
                lost = self._still_lacking(node, everyone)
                over = node.over_granted(everyone)
                for rt, cs in by_rt.items():
                    cell = self.cells[rt]
                    cell.events += 1
                    cell.losses += sum(c in lost for c in cs)
                    cell.over_grants += sum(c in over for c in cs)
                for c in lost:
                    node.hook_grant(c)  # each event judged on its own
        found = set(found_by_gpuguard(node))
        for rt, cs in by_rt.items():
            self.cells[rt].found = sum(c.container_id in found for c in cs)
        node.remove_all()

    def write_not_run(self, runtime: str, directory: Path, test: str) -> Path:
        """The cell of a runtime that could not make a container here, and why."""
        cell = Cell(
            self.suite,
            self.layout,
            runtime,
            {**self.versions, "runtime": self.versions.get(runtime, "")},
            self.install,
            [],
            {},
            notes=[self.not_run[runtime]],
        )
        out = cell.write(directory, test)
        doc = json.loads(out.read_text())
        doc["result"] = "not run"
        out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        return out

    @staticmethod
    def _settled_losses(node: Node, ctrs: List[Ctr], within: float = 3.0) -> List[Ctr]:
        """Who lacks their GPU once that stops changing (systemd may re-apply a scope a
        moment after systemctl has returned): the same answer twice, 0.3 s apart."""
        deadline = time.monotonic() + within
        lost = node.lacking(ctrs)
        while time.monotonic() < deadline:
            time.sleep(0.3)
            again = node.lacking(ctrs)
            if again == lost:
                break
            lost = again
        return lost

    @staticmethod
    def _still_lacking(node: Node, ctrs: List[Ctr], grace: float = 3.0) -> List[Ctr]:
        """Containers denied their GPU once gpuguard's passes are quiet (a pass that
        only starts a little later gets ``grace`` seconds)."""
        deadline = time.monotonic() + grace
        lost = node.lacking(ctrs)
        while lost and time.monotonic() < deadline:
            time.sleep(0.2)
            lost = node.lacking(lost)
        return lost

    @staticmethod
    def _apply(node: Node, event: str, ctrs: List[Ctr]) -> List[str]:
        """One disruptive event; returns notes (runtime updates that failed)."""
        notes: List[str] = []
        actions: Dict[str, Callable[[], None]] = {
            "daemon-reload": lambda: node.ns.systemctl("daemon-reload", timeout=60) and None,
            "daemon-reexec": lambda: node.ns.systemctl("daemon-reexec", timeout=60) and None,
        }
        if event in actions:
            actions[event]()
        elif event == "runtime-update":
            for c in ctrs:
                err = node.update(c)
                if err:
                    notes.append(f"{c.runtime} update exited non-zero: {err.splitlines()[-1]}")
        elif event == "device-allow-reset":
            for c in ctrs:
                node.reset(c)
        return sorted(set(notes))
