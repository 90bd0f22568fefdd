"""The support matrix and the F1 matrix (docs/support-matrix.md) and docs/devices.md's
reload table, from the stack runs.

tests/integration/test_stacks_f2.py writes one JSON document per F2 cell (release,
cgroup layout, runtime) to build/stacks/, tests/integration/test_kubelet_f1.py one per
F1 run on the real kubelet (``"scenario": "f1"``: stack, layout, case, with or without
gpuguard). ``scripts/stack-matrix`` merges them into docs/stack-matrix.json
(committed: the results the docs show) and renders the tables from it between their
markers (the F1 matrix: one row per stack); tests/unit/test_stack_matrix.py fails when
a committed table differs from what docs/stack-matrix.json renders.

    scripts/stack-matrix            # merge build/stacks/*.json, rewrite the tables
    scripts/stack-matrix --check    # exit 1 if a table is out of date
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "stack-matrix.json"
RUNS = REPO / "build" / "stacks"
SUPPORT = REPO / "docs" / "support-matrix.md"
DEVICES = REPO / "docs" / "devices.md"
ORDER = {"bullseye": 0, "bookworm": 1, "trixie": 2, "sid": 3}
RELEASE = {
    "bullseye": "Debian 11",
    "bookworm": "Debian 12",
    "trixie": "Debian 13",
    "sid": "Debian sid",
}
EVENTS = ("daemon-reload", "daemon-reexec", "runtime-update", "device-allow-reset")

F1_CASES = ("all", "one", "gone")

Cell = Dict[str, Any]


def scenario(c: Cell) -> str:
    return str(c.get("scenario", "f2"))


def key(c: Cell) -> Tuple[int, str, str, str, str, int, str]:
    case = F1_CASES.index(c["case"]) if c.get("case") in F1_CASES else 9
    return (
        ORDER.get(c["suite"], 9),
        scenario(c),
        c.get("stack", ""),
        c["layout"],
        c.get("runtime", ""),
        case,
        c.get("gpuguard", ""),
    )


def load(path: Path = RESULTS) -> List[Cell]:
    return sorted(json.loads(path.read_text()), key=key)


def merge(old: List[Cell], runs: List[Cell]) -> List[Cell]:
    """``runs`` replace the cells of ``old`` with the same :func:`key` (F2: release,
    layout, runtime; F1: stack, layout, case, with or without gpuguard)."""
    by = {key(c): c for c in old}
    by.update({key(c): c for c in runs})
    return sorted(by.values(), key=key)


def result_text(c: Cell) -> str:
    if c["result"] == "pass":
        return "pass"
    if c["result"] == "not run":
        return "not run here (" + c["notes"][0].split(":")[0] + ")"
    known = c.get("known") or ""
    return "**fails**" + (f" ({known.split(':')[0]})" if known else "")


def render_support(cells: List[Cell]) -> str:
    head = (
        "| release | systemd | containerd | runtime | Python | layout | gpuguard installed as "
        "| result | containers | found | events | losses | over-grants | narrowed | proven by |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for c in cells:
        if scenario(c) != "f2":
            continue
        v = c["versions"]
        layout = "v2 (unified)" if c["layout"] == "v2" else "v1 (hybrid)"
        privileged = c.get("privileged", 0)
        made = (
            f"{c['containers']} + {privileged} privileged" if privileged else str(c["containers"])
        )
        counts = (
            ["", "", "", "", "", ""]
            if c["result"] == "not run"
            else [
                made,
                str(c["found"]),
                *(str(c[k]) for k in ("events", "losses", "over_grants")),
                str(c["narrowed"]) if "narrowed" in c else "",
            ]
        )
        test = c["test"].split("::", 1)[1] if "::" in c["test"] else c["test"]
        rows.append(
            "| "
            + " | ".join(
                [
                    f"{RELEASE.get(c['suite'], c['suite'])} ({c['suite']})",
                    v["systemd"],
                    v["containerd"],
                    f"{c['runtime']} {v['runtime']}",
                    v["python"],
                    layout,
                    c["install"],
                    result_text(c),
                    *counts,
                    f"`{test}`",
                ]
            )
            + " |"
        )
    return head + "\n".join(rows) + "\n"


def lost(c: Cell, event: str) -> str:
    n = c["exposure"].get(event)
    if n is None:
        return ""
    return f"lost {n} of {c['containers']}" if n else f"kept ({c['containers']})"


def render_reload(cells: List[Cell]) -> str:
    """What each systemd version did, gpuguard stopped, to runc containers whose GPU the
    legacy hook granted behind its back."""
    head = (
        "| systemd (release) | layout | daemon-reload | daemon-reexec | runc update "
        "| `DeviceAllow=` reset |\n|---|---|---|---|---|---|\n"
    )
    rows = []
    for c in cells:
        if scenario(c) != "f2" or c["runtime"] != "runc" or c["result"] == "not run":
            continue
        rows.append(
            f"| {c['versions']['systemd']} ({c['suite']}) | {c['layout']} | "
            + " | ".join(
                [
                    lost(c, "daemon-reload"),
                    lost(c, "daemon-reexec"),
                    f"{lost(c, 'runtime-update')} (runc {c['versions']['runc']})",
                    lost(c, "device-allow-reset"),
                ]
            )
            + " |"
        )
    return head + "\n".join(rows) + "\n"


def f1_stack(c: Cell) -> str:
    where = (
        "this machine's own, in a systemd namespace"
        if c["stack"].startswith("host")
        else "a debootstrapped root booted with its own systemd"
    )
    return f"{RELEASE.get(c['suite'], c['suite'])} ({c['suite']}): {where}"


def f1_runs(runs: List[Cell], mode: str) -> str:
    out = []
    for c in runs:
        if c["gpuguard"] != mode:
            continue
        back = f"{c['pods_back']}/{c['pods_before']}"
        if c["result"] != "pass":
            out.append(f"{c['case']}: **fails** ({back})")
        elif mode == "yes":
            gone = " (gpu-b's GPU gone: left out)" if c["case"] == "gone" else ""
            out.append(f"{c['case']}: {back} back{gone}, {c['seconds']} s")
        else:
            out.append(f"{c['case']}: {back} ({c['outcome']})")
    return "; ".join(out)


def cri_api(seen: str) -> str:
    """The CRI API version in kubelet's line naming its runtime, as the node recorded it
    ("containerd 1.7.24~ds1, apiVersion v1alpha2")."""
    return seen.rsplit("apiVersion ", 1)[-1] if "apiVersion " in seen else "?"


def render_f1(cells: List[Cell]) -> str:
    """One row per stack: what kubelet 1.20 did after a reboot into new GPU UUIDs,
    without gpuguard and with it (pods back, seconds from kubelet's start to every
    GPU pod Running)."""
    head = (
        "| stack | kubelet | systemd | containerd (kubelet's CRI) | runc | Python | layout "
        "| gpuguard installed as | without gpuguard | with gpuguard: pods back, seconds to "
        "Running | result | proven by |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    stacks: Dict[Tuple[str, str], List[Cell]] = {}
    for c in cells:
        if scenario(c) == "f1":
            stacks.setdefault((c["stack"], c["layout"]), []).append(c)
    rows = []
    for (stack, layout), runs in stacks.items():
        with_gg = [c for c in runs if c["gpuguard"] == "yes"] or runs
        v = with_gg[0]["versions"]
        ok = all(c["result"] == "pass" for c in runs)
        test = runs[0]["test"].split("::", 1)[0]
        rows.append(
            "| "
            + " | ".join(
                [
                    f1_stack(runs[0]),
                    v.get("kubelet", ""),
                    v.get("systemd", ""),
                    f"{v.get('containerd', '')} ({cri_api(v.get('runtime_seen', ''))})",
                    v.get("runc", ""),
                    v.get("python", ""),
                    "v2 (unified)" if layout == "v2" else "v1 (hybrid)",
                    with_gg[0]["install"],
                    f1_runs(runs, "none"),
                    f1_runs(runs, "yes"),
                    "pass" if ok else "**fails**",
                    f"`{test}` `[{stack}-*]`",
                ]
            )
            + " |"
        )
    return head + "\n".join(rows) + "\n"


def markers(name: str) -> Tuple[str, str]:
    return (
        f"<!-- {name}: generated by scripts/stack-matrix from docs/stack-matrix.json -->\n",
        f"<!-- end {name} -->",
    )


def block(text: str, name: str) -> str:
    begin, end = markers(name)
    if begin not in text or end not in text:
        raise ValueError(f"no {name} markers")
    return text.split(begin, 1)[1].split(end, 1)[0]


def replace(text: str, name: str, body: str) -> str:
    begin, end = markers(name)
    head, rest = text.split(begin, 1)
    return head + begin + body + end + rest.split(end, 1)[1]


TABLES = (
    (SUPPORT, "stack-matrix", render_support),
    (SUPPORT, "f1-matrix", render_f1),
    (DEVICES, "reload-table", render_reload),
)


def stale(cells: List[Cell]) -> List[str]:
    return [
        f"{path.relative_to(REPO)}: {name}"
        for path, name, render in TABLES
        if block(path.read_text(), name) != render(cells)
    ]


def main(argv: List[str]) -> int:
    if argv[1:] == ["--check"]:
        out = stale(load())
        for s in out:
            print(f"out of date: {s} (run scripts/stack-matrix)", file=sys.stderr)
        return 1 if out else 0
    if argv[1:]:
        print("usage: scripts/stack-matrix [--check]", file=sys.stderr)
        return 2
    runs = [json.loads(p.read_text()) for p in sorted(RUNS.glob("*.json"))]
    old = load() if RESULTS.exists() else []
    cells = merge(old, runs)
    RESULTS.write_text(json.dumps(cells, indent=1, sort_keys=True) + "\n")
    for path, name, render in TABLES:
        path.write_text(replace(path.read_text(), name, render(cells)))
    print(f"{len(runs)} run(s) merged into {RESULTS.relative_to(REPO)} ({len(cells)} cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
