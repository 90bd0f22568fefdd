"""Every echo bounded and escaped, and the three states agreeing everywhere.

Echoes: configuration values (control characters, 100,000 characters, in every key),
the node's own configuration files and command output as `gpuguard doctor` quotes them
(a 300 KB value, escape sequences, a `runc --version` printing 300 KB), checkpoint
device IDs with 4,300-digit suffixes, the installer's os-release values. Every line
printed is printable and bounded.

States: generated step results (findings open or repaired, layers not seen, crashes,
old results) give the same verdict per condition in `gpuguard npd` (0, 1, 2), the
metrics (`gpuguard_node_condition_status`), the daemon's own `conditions` and `gpuguard
status`; a condition with nothing seen is never OK.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

import statusdoc
from conftest import REPO
from fakenode import assert_clean, run_cli
from fuzz.budget import budget
from gpuguard.config import KEYS
from gpuguard.reporting.metrics_state import MetricsState
from gpuguard.reporting.npd import CONDITIONS, STATE_NAMES, evaluate, judge_conditions
from gpuguard.reporting.status import SPEC as STATUS_SPEC
from gpuguard.reporting.status import Status
from unit.doctor_support import healthy_node

_outside = st.one_of(
    st.sampled_from(
        [
            "\x1b[2J\x1b[31mred",
            "a\nb",
            "\r\x07",
            "\u202eevil",
            "\u2028",
            "x" * 100_000,
            "kubelet.service " * 10_000,
            "9" * 4301 + "s",
        ]
    ),
    st.text(min_size=1, max_size=20),
)


def _printable_and_bounded(text: str, limit: int = 2100) -> None:
    for line in text.splitlines():
        assert line.isprintable() and len(line) <= limit, line[:200]


@budget(40)
@given(st.sampled_from([(k.section, k.key) for k in KEYS]), _outside)
@example(("Runtime", "RuntimeUnits"), "x" * 100_000)
@example(("Daemon", "LogLevel"), "\x1b[31mdebug")
def test_configuration_values_are_echoed_bounded(key: tuple[str, str], value: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        conf = Path(d) / "etc/gpuguard/gpuguard.conf"
        conf.parent.mkdir(parents=True)
        conf.write_text(f"[{key[0]}]\n{key[1]}={value}\n", errors="surrogatepass")
        run = run_cli("config", "--root", d)
        assert_clean(run, ["config"])
        _printable_and_bounded(run.err, 520)
        if run.code == 0:
            _printable_and_bounded(run.out, 5000)


RUNC = "#!/bin/sh\nprintf 'runc version 1.1.12\\n'\nhead -c 300000 /dev/zero | tr '\\\\0' x\n"


@budget(15)
@given(_outside, _outside)
@example("x" * 300_000, "\x1b[2J")
def test_doctor_quotes_the_nodes_files_and_commands_bounded(a: str, b: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = healthy_node(Path(d))
        (root / "var/lib/kubelet/config.yaml").write_text(
            f"cgroupDriver: {a}\ncpuManagerPolicy: {b}\n", errors="surrogatepass"
        )
        (root / "etc/nvidia-container-runtime/config.toml").write_text(
            f'[nvidia-container-runtime]\nmode = "{a}"\n', errors="surrogatepass"
        )
        runc = root / "usr/bin/runc"
        runc.parent.mkdir(parents=True, exist_ok=True)
        runc.write_text(RUNC)
        runc.chmod(0o755)
        for argv in (["doctor"], ["doctor", "--json"]):
            run = run_cli(*argv, "--root", d, "--inventory", str(root / "inventory.json"))
            assert_clean(run, argv)
            if "--json" in argv:
                for c in run.json()["checks"]:
                    assert len(c["evidence"]) <= 400 and c["evidence"].isprintable()
            else:
                _printable_and_bounded(run.out, 900)  # evidence and fix: 400 each


def test_a_4300_digit_device_id_suffix_is_never_echoed_whole(tmp_path: Path) -> None:
    from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, marshal

    huge = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c::" + "9" * 4300
    entry = PodDevicesEntry("pod", "c", "nvidia.com/gpu", (("0", (huge, "GPU-gone-1")),), b"")
    cp = Checkpoint("v2", (entry,), (("nvidia.com/gpu", (huge, "GPU-gone-1")),), 0, None)
    path = tmp_path / "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
    path.parent.mkdir(parents=True)
    path.write_bytes(marshal(cp))
    inv = tmp_path / "inv.json"
    inv.write_text(json.dumps({"gpus": []}))
    for argv in (["check", "--dry-run"], ["check", "--dry-run", "--json"]):
        run = run_cli(*argv, "--root", str(tmp_path), "--inventory", str(inv))
        assert_clean(run, argv)
        assert "9" * 300 not in run.out + run.err  # cut: at most a few hundred characters


_os_release = st.lists(
    st.tuples(st.sampled_from(["ID", "ID_LIKE", "VERSION_ID", "VARIANT_ID", "X"]), _outside),
    max_size=4,
)


@budget(20)
@given(_os_release)
@example([("ID", "*"), ("ID_LIKE", "debian")])
@example([("ID", '"evilos debian"')])
def test_installer_os_release_values_are_data(pairs: list[tuple[str, str]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "host"
        (root / "etc").mkdir(parents=True)
        (root / "run/systemd/system").mkdir(parents=True)
        (root / "usr/bin").mkdir(parents=True)
        text = "".join(f"{k}={v}\n" for k, v in pairs)
        (root / "etc/os-release").write_text(text, errors="surrogatepass")
        cwd = Path(d) / "cwd"
        cwd.mkdir()
        (cwd / "debian").write_text("")  # where a glob would find it
        env = {
            "PATH": "/usr/bin:/bin",
            "GPUGUARD_INSTALLER_HOST_ROOT": str(root),
            "GPUGUARD_INSTALLER_TARGET_PID": "2147483647",
            "GPUGUARD_INSTALLER_STATUS": str(Path(d) / "status"),
            "GPUGUARD_INSTALLER_ONESHOT": "1",
        }
        p = subprocess.run(
            ["/bin/sh", str(REPO / "deploy/gpuguard-installer"), "detect"],
            env=env,
            cwd=cwd,
            capture_output=True,
            timeout=30,
            check=False,
        )
        out = p.stdout.decode("utf-8", "replace") + p.stderr.decode("utf-8", "replace")
        assert p.returncode == 3, out  # no package manager here: never served
        _printable_and_bounded(out, 500)
        ids = [v for k, v in pairs if k == "ID"]
        if (ids and "*" in ids[-1]) or any(" " in v for k, v in pairs if k == "ID"):
            assert "not an os-release ID" in out or "immutable" in out, out


# ---------------------------------------------------------------------- three states

_step = st.fixed_dictionaries(
    {},
    optional={
        "findings": st.lists(
            st.sampled_from(
                [
                    {"kind": k, "summary": f"{k} here"}
                    for c in CONDITIONS
                    for k in sorted(c.kinds)[:1]
                ]
                + [{"kind": "char-link-missing", "summary": "other"}]
            ),
            max_size=2,
        ),
        "outcomes": st.lists(
            st.sampled_from([{"status": "done"}, {"status": "failed"}, {"status": "skipped"}]),
            max_size=2,
        ),
        "unknown": st.lists(st.sampled_from(["no GPU inventory", "PCI unreadable"]), max_size=1),
        "error": st.sampled_from([None, "ValueError: boom"]),
        "age": st.sampled_from([5, 9000]),
    },
)


def _status(steps: dict[str, Any], now: float) -> Status:
    doc = {}
    for name, s in steps.items():
        s = dict(s)
        s["ended"] = now - s.pop("age", 5)
        doc[name] = s
    return statusdoc.model({"steps": doc, "last_pass": {"ended": now}}, now)


@budget(60)
@given(st.dictionaries(st.sampled_from([c.steps[0] for c in CONDITIONS]), _step))
@example({})
def test_every_report_gives_the_same_state(steps: dict[str, Any]) -> None:
    now = time.time()
    status = _status(steps, now)
    node, conditions = judge_conditions(status.steps, now)
    m = MetricsState()
    assert status.last_pass is not None
    m.observe_pass(status.last_pass, status)
    series = {
        labels: value
        for labels, value in m.values["gpuguard_node_condition_status"].items()
        if value == 1
    }
    for c in CONDITIONS:
        code, _msg = evaluate(c, status.steps, now, 7200)
        state = STATE_NAMES[code]
        assert conditions[c.type].state == state
        label = {"problem": "true", "ok": "false", "unknown": "unknown"}[state]
        assert (c.type, label) in series
        st_ = status.steps.get(c.steps[0])
        if st_ is None or st_.error or st_.unknown or now - st_.ended > 7200:
            assert state != "ok"  # nothing seen is never OK
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "proc/4242").mkdir(parents=True)
        f = root / "run/gpuguard/status.json"
        f.parent.mkdir(parents=True)
        f.write_bytes(STATUS_SPEC.encode(status))
        for c in CONDITIONS:
            run = run_cli("npd", c.name, "--root", d)
            assert STATE_NAMES[run.code] == conditions[c.type].state
        inv = root / "inv.json"
        inv.write_text('{"gpus": []}')
        run = run_cli("status", "--root", d, "--inventory", str(inv))
        assert run.out.splitlines()[0] == f"node:       {node.upper()}", run.out
