"""The shape of the code: one home per step, pure reconcilers, libraries that know no
step, small modules.

Every step of the registry lives in `steps/<name>/`. A reconcile module decides from
what it is given: it imports no `os`, no `subprocess`, no actuator, no D-Bus client and
no `commands` (checked on the source with `ast`, so a lazy import inside a function counts too).
`devices/` and `checkpoint/` import no step, actuator, D-Bus client or `commands`.
A module of the package fits in a head: at most MAX_LINES lines, or it is listed in
LONG_MODULES with the reason it may be longer. In the container access step only the
two implementations of a container's device cgroup (cgroupv1.py, cgroupv2.py) look at
which layout a container is on. The CLI's step calls are typed: no `Any` in the
annotations of the modules that build and run steps.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuguard.steps import registry

SRC = Path(__file__).resolve().parents[2] / "src" / "gpuguard"
# Modules a reconciler must not import: the OS, commands, D-Bus, anything that writes.
FORBIDDEN = (
    "os",
    "subprocess",
    "shutil",
    "gpuguard.host.commands",
    "gpuguard.host.systemd",
    "dbus_next",
)
# Pure helpers of a reconciler, held to the same rule.
PURE = (
    SRC / "steps/checkpoint/deviceids.py",
    SRC / "steps/checkpoint/gpumap.py",
    SRC / "steps/checkpoint/remap.py",
    SRC / "steps/checkpoint/remapguard.py",
    SRC / "steps/checkpoint/translate.py",
    SRC / "steps/device_plugin/limits.py",
    SRC / "steps/device_plugin/allocatable.py",
    SRC / "steps/container_access/inplace.py",
    SRC / "steps/container_access/durable.py",
    SRC / "steps/container_access/bridgeplan.py",
    SRC / "steps/container_access/view.py",
)
# Modules aim at under about 400 lines; past this one a module is split by what it holds.
MAX_LINES = 450
# Modules allowed past MAX_LINES, by path under src/gpuguard, each with its reason.
LONG_MODULES: dict[str, str] = {}


def imported(source: str) -> set[str]:
    """Every module `source` imports, `from a import b` giving both a and a.b."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def impurities(source: str) -> list[str]:
    bad = []
    for name in sorted(imported(source)):
        parts = name.split(".")
        if (
            any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
            or "actuate" in parts
            or parts[-1] == "actuate"
        ):
            bad.append(name)
    return bad


def reconcile_modules() -> list[Path]:
    return sorted(SRC.glob("steps/*/reconcile.py")) + list(PURE)


def test_every_step_of_the_registry_has_its_package() -> None:
    for spec in registry.STEPS:
        module = spec.load.partition(":")[0]
        assert module == f"gpuguard.steps.{spec.name}", spec
        assert (SRC / "steps" / spec.name / "__init__.py").is_file()
        assert (SRC / "steps" / spec.name / "reconcile.py").is_file()


def test_the_reconcile_modules_are_found() -> None:
    names = {p.parent.name for p in reconcile_modules()}
    assert names >= {"container_access", "checkpoint", "device_nodes", "device_plugin", "gpu_count"}


@pytest.mark.parametrize("path", reconcile_modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_reconcile_modules_import_nothing_that_acts(path: Path) -> None:
    assert impurities(path.read_text()) == [], f"{path.relative_to(SRC)} must stay pure"


@pytest.mark.parametrize(
    "line",
    [
        "import os",
        "import os.path",
        "from os import listdir",
        "import subprocess",
        "from gpuguard.host.commands import run",
        "from gpuguard.host import commands",
        "from gpuguard.host.systemd import Systemd",
        "from gpuguard.steps.checkpoint.actuate import CheckpointActuator",
        "from gpuguard.steps.checkpoint import actuate",
        "from gpuguard.actuate.files import write_new",
        "def f():\n    import subprocess",
    ],
)
def test_the_check_catches_each_kind_of_impure_import(line: str) -> None:
    assert impurities(line) != []


def test_pure_imports_pass() -> None:
    src = "from dataclasses import dataclass\nfrom gpuguard.model import Finding\nimport re\n"
    assert impurities(src) == []


# Libraries of host and format knowledge: the steps share them, they know no step.
LIBRARIES = ("devices", "checkpoint")
LIBRARY_FORBIDDEN = (
    "gpuguard.steps",
    "gpuguard.actuate",
    "gpuguard.host.systemd",
    "gpuguard.host.commands",
)


@pytest.mark.parametrize(
    "path",
    sorted(p for lib in LIBRARIES for p in (SRC / lib).rglob("*.py")),
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_libraries_import_no_step_actuator_or_client(path: Path) -> None:
    bad = [
        n
        for n in sorted(imported(path.read_text()))
        if any(n == f or n.startswith(f + ".") for f in LIBRARY_FORBIDDEN)
    ]
    assert bad == [], f"{path.relative_to(SRC)} is a library: {bad}"


def module_lines() -> dict[str, int]:
    return {
        str(p.relative_to(SRC)): len(p.read_text().splitlines())
        for p in sorted(SRC.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def test_modules_stay_small() -> None:
    lines = module_lines()
    assert len(lines) > 50  # the package was found
    long = {m: n for m, n in lines.items() if n > MAX_LINES and m not in LONG_MODULES}
    assert not long, (
        f"split these by what they hold (or list them in LONG_MODULES, with why): {long}"
    )


def test_every_long_module_exception_is_still_needed() -> None:
    lines = module_lines()
    stale = [m for m in LONG_MODULES if lines.get(m, 0) <= MAX_LINES]
    assert not stale, f"no longer long (or gone): drop them from LONG_MODULES: {stale}"


# -- one implementation per cgroup layout ---------------------------------------------

ACCESS = SRC / "steps" / "container_access"
# The two implementations of DeviceCgroup (devcgroup.py): the only modules of the step
# that may ask which layout a container is on.
LAYOUT_IMPLEMENTATIONS = {"cgroupv1.py", "cgroupv2.py"}
# Which hierarchy's path a container has: the layout itself
LAYOUT_PATHS = {"cgroup_v1_devices", "cgroup_v2", "process_v1", "process_v2", "v1_dir", "v2_dir"}
# What a layout or a mechanism is called (ContainerCgroup.layout, .mechanism,
# CgroupLayout.kind): compared with one of these, it is a branch on the layout
LAYOUT_NAMES = {"v1", "v2", "hybrid", "unified", "legacy",
                "v1-rule", "scope-device-allow", "own-program"}  # fmt: skip


def layout_checks(source: str) -> list[str]:
    """Where `source` looks at a container's layout: a hierarchy's path read, or a
    layout's name (or a `.layout`/`.mechanism`) compared."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in LAYOUT_PATHS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Compare):
            for o in (node.left, *node.comparators):
                named = isinstance(o, ast.Constant) and o.value in LAYOUT_NAMES
                attr = isinstance(o, ast.Attribute) and o.attr in ("layout", "mechanism")
                if named or attr:
                    found.append(f"line {node.lineno}: compares {ast.unparse(o)}")
    return found


@pytest.mark.parametrize(
    "path",
    sorted(p for p in ACCESS.glob("*.py") if p.name not in LAYOUT_IMPLEMENTATIONS),
    ids=lambda p: p.name,
)
def test_only_the_two_implementations_look_at_a_containers_layout(path: Path) -> None:
    assert layout_checks(path.read_text()) == [], (
        f"{path.name}: a v1/v2 difference belongs in cgroupv1.py / cgroupv2.py, behind "
        "devcgroup.DeviceCgroup"
    )


def test_both_implementations_exist_and_do_look() -> None:
    for name in LAYOUT_IMPLEMENTATIONS:
        assert layout_checks((ACCESS / name).read_text()), name


@pytest.mark.parametrize(
    "line",
    [
        "if c.cgroup_v1_devices is not None:\n    pass",
        "x = c.cgroup_v2",
        "v2 = [p for p in pairs if p[0].cgroup_v1_devices is None]",
        "if c.layout == 'v1':\n    pass",
        "ok = c.mechanism != 'own-program'",
        "if layout.kind == 'unified':\n    pass",
        "if 'v2' in (a, b):\n    pass",
    ],
)
def test_the_layout_check_catches_each_kind_of_branch(line: str) -> None:
    assert layout_checks(line) != []


def test_a_layout_named_as_a_journal_field_is_no_branch() -> None:
    assert layout_checks('fields = {"CGROUP_LAYOUT": c.layout, "LAYOUT": "v2"}') == []


# -- the CLI's step calls are typed -----------------------------------------------------

# The modules that build the steps and run them for a command; `_opt` reads argparse's
# untyped namespace (its callers know the type)...
TYPED_CLI = (
    "cli/check.py",
    "cli/daemon.py",
    "cli/args.py",
    "engine/oneshot.py",
    "engine/runner.py",
)
UNTYPED_BY_NATURE = {"opt", "daemon_status", "_status_shape_ok"}


def any_annotations(source: str) -> list[str]:
    """Functions of `source` with `Any` in a parameter's or the return's annotation."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        annotations = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        annotations += [a.vararg.annotation if a.vararg else None, node.returns]
        annotations += [a.kwarg.annotation if a.kwarg else None]
        for ann in annotations:
            if ann is not None and any(
                isinstance(n, ast.Name) and n.id == "Any" for n in ast.walk(ann)
            ):
                bad.append(node.name)
                break
    return bad


@pytest.mark.parametrize("module", TYPED_CLI)
def test_the_clis_step_calls_are_typed_without_any(module: str) -> None:
    bad = set(any_annotations((SRC / module).read_text())) - UNTYPED_BY_NATURE
    assert not bad, f"{module}: type these with the real types (TYPE_CHECKING imports): {bad}"


def test_the_any_check_finds_any() -> None:
    assert any_annotations("def f(x: Any) -> int: ...") == ["f"]
    assert any_annotations("def f(x: int) -> Optional[Any]: ...") == ["f"]
    assert any_annotations("def f(x: int) -> int: ...") == []


# -- one way to read what gpuguard does not own (host/safeio.py) -----------------------

# Calls that open, read or parse a file. Anywhere but the modules below, a host path is
# read through safeio (non-blocking, regular files only, no links unless asked, bounded
# by the bytes read) and a state file through host/statefile.py's loader.
READ_CALLS = frozenset(
    {"open", "os.open", "os.read", "os.fdopen", "io.open", "json.load", "json.loads"}
)
READ_METHODS = frozenset({"read_text", "read_bytes"})  # pathlib: unbounded, follows links
# module under src/gpuguard -> (the calls it may make, why)
READERS: dict[str, tuple[frozenset[str], str]] = {
    "host/safeio.py": (frozenset({"os.open", "os.read"}), "the bounded reader itself"),
    "host/statefile.py": (frozenset({"json.loads"}), "the state files' loader"),
    "checkpoint/codec.py": (frozenset({"json.loads"}), "kubelet's format, from safeio bytes"),
    "host/inventory.py": (frozenset({"json.loads"}), "the inventory file, from safeio bytes"),
    "host/kubeapi.py": (
        frozenset({"json.loads"}),
        "the API server's answer, bounded by its size (files through safeio)",
    ),
    "actuate/files.py": (frozenset({"os.open"}), "atomic writes: directories, temp files"),
    "actuate/safewrite.py": (frozenset({"os.open"}), "control files, device nodes' handles"),
    "actuate/bpf.py": (
        frozenset({"os.open", "os.read"}),
        "a cgroup's cgroup.events relative to its open directory: one read of a page, "
        "regular file checked (the reload sweep's path)",
    ),
    "devices/probe.py": (frozenset({"os.open"}), "opening the device node is the probe"),
    "devices/kubeletstart.py": (
        frozenset({"os.open"}),
        "an O_PATH handle of kubelet.sock (nothing read): its stat and a connect to it",
    ),
    "devices/cgroupchild.py": (
        frozenset({"os.open", "os.read"}),
        "the forked child joins cgroups (no link, non-blocking); the parent reads its pipe",
    ),
    "steps/device_plugin/nvml_probe.py": (
        frozenset({"os.open", "json.loads"}),
        "the plugin's mount namespace for setns; the child's bounded report on a pipe",
    ),
    "host/nvmllib.py": (
        frozenset({"os.open"}),
        "NVML's library opened (never read) to be loaded through its descriptor, the file checked",
    ),
    "host/commands.py": (
        frozenset({"os.read"}),
        "run_as_nobody: a child's output on its pipe, bounded (4 KiB)",
    ),
    "readmit/observe.py": (
        frozenset({"os.open"}),
        "kubelet's executable opened (never read) to be run through its descriptor",
    ),
    "steps/device_plugin/podresources.py": (
        frozenset({"os.open"}),
        "the socket's directory opened O_PATH, to connect relative to it",
    ),
    "sources/transient.py": (frozenset({"os.read"}), "its inotify descriptor"),
    "readmit/watch.py": (frozenset({"os.read"}), "its inotify descriptor"),
    "readmit/ended.py": (
        frozenset({"os.open"}),
        "an O_PATH descriptor of kubelet's device-plugins directory, to connect to "
        "kubelet.sock through it (nothing is read)",
    ),
    "host/threadclock.py": (
        frozenset({"open"}),
        "the calling thread's own schedstat, on the reload fast path (a kernel file of "
        "this process, never a fake root's)",
    ),
}


def read_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) for every call in `source` that opens, reads or parses a file."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "open":
            out.append((node.lineno, "open"))
        elif isinstance(f, ast.Attribute):
            base = f.value.id if isinstance(f.value, ast.Name) else ""
            name = f"{base}.{f.attr}"
            if base == "safeio":  # the bounded reader's own read_bytes/read_text
                continue
            if name in READ_CALLS or f.attr in READ_METHODS:
                out.append((node.lineno, name if name in READ_CALLS else f".{f.attr}"))
    return out


def test_host_files_are_read_only_through_the_bounded_reader() -> None:
    bad = []
    for p in sorted(SRC.rglob("*.py")):
        rel = str(p.relative_to(SRC))
        allowed = READERS.get(rel, (frozenset(), ""))[0]
        bad += [
            f"{rel}:{line}: {call}"
            for line, call in read_calls(p.read_text())
            if call not in allowed
        ]
    assert not bad, (
        "read host files through gpuguard.host.safeio (state files through "
        f"host/statefile.py's loader), or add the module to READERS with why: {bad}"
    )


def test_every_reader_exception_is_still_needed() -> None:
    for rel, (calls, _why) in READERS.items():
        found = {c for _line, c in read_calls((SRC / rel).read_text())}
        assert calls <= found, f"{rel} no longer makes {sorted(calls - found)}: drop them"


@pytest.mark.parametrize(
    "line",
    [
        "open('/etc/x').read()",
        "import os\nos.open('/x', os.O_RDONLY)",
        "from pathlib import Path\nPath('/x').read_text()",
        "p.read_bytes()",
        "import json\njson.load(f)",
        "import json\njson.loads(data)",
        "def f():\n    with open(p, 'rb') as fh:\n        return fh",
    ],
)
def test_the_reader_check_catches_each_kind_of_read(line: str) -> None:
    assert read_calls(line)


# -- one writer of gpuguard's state files (actuate/statefile.py) -----------------------

WRITE_HELPERS = frozenset({"write_new", "atomic_replace"})
# module -> why it may call the atomic-write helpers itself
WRITERS: dict[str, str] = {
    "actuate/files.py": "the helpers themselves",
    "actuate/statefile.py": "the one writer of gpuguard's state files",
    "actuate/dropins.py": "systemd drop-ins, unit files systemd reads (not state files)",
    "steps/checkpoint/actuate.py": "kubelet's checkpoint, kubelet's file, with its backup",
    "reporting/metrics_output.py": "node_exporter's textfile, in node_exporter's directory",
    "actuate/offswitch.py": "the off switch, an operator's plain-text file in /etc/gpuguard",
}


def test_state_files_are_written_only_through_the_state_file_actuator() -> None:
    bad = []
    for p in sorted(SRC.rglob("*.py")):
        rel = str(p.relative_to(SRC))
        if rel in WRITERS:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
                if name in WRITE_HELPERS:
                    bad.append(f"{rel}:{node.lineno}: {name}")
    assert not bad, f"write state files with actuate.statefile.write_state: {bad}"


# One C library lookup (host/libc.py) and one home for inotify's flags (host/inotify.py).
LIBC_HOME, INOTIFY_HOME = "host/libc.py", "host/inotify.py"


def c_library_loads(source: str) -> list[int]:
    """Lines of `source` that load the process's C library: CDLL(None)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "CDLL"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value is None
    ]


def inotify_flags(source: str) -> list[str]:
    """Module-level names of `source` assigned an inotify flag (IN_...)."""
    return [
        t.id
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name) and t.id.startswith("IN_")
    ]


def test_the_c_library_is_looked_up_in_one_module() -> None:
    bad = {
        str(p.relative_to(SRC)): lines
        for p in sorted(SRC.rglob("*.py"))
        if str(p.relative_to(SRC)) != LIBC_HOME and (lines := c_library_loads(p.read_text()))
    }
    assert not bad, f"ctypes.CDLL(None) outside {LIBC_HOME} (use c_library/function): {bad}"
    assert c_library_loads((SRC / LIBC_HOME).read_text())


def test_inotify_flags_are_defined_in_one_module() -> None:
    bad = {
        str(p.relative_to(SRC)): names
        for p in sorted(SRC.rglob("*.py"))
        if str(p.relative_to(SRC)) != INOTIFY_HOME and (names := inotify_flags(p.read_text()))
    }
    assert not bad, f"inotify flags outside {INOTIFY_HOME}: {bad}"


@pytest.mark.parametrize(
    "line", ["x = ctypes.CDLL(None)", "x = CDLL(None, use_errno=True)", "IN_CREATE = 0x100"]
)
def test_the_libc_and_inotify_checks_catch_each_form(line: str) -> None:
    assert c_library_loads(line) or inotify_flags(line)


# No untyped rows: no `dict[str, Any]` in a function's signature under src/, except
# where a value becomes or comes from a document: a serialiser (to_json, *_json,
# render/_render*: the status file, --json, the state files), a reader of a document
# as parsed (json/TOML/YAML, before it is typed), or a name below with its reason.
SERIALISER_PREFIXES, SERIALISER_SUFFIXES = ("render", "_render"), ("to_json", "_json")
PARSED_DOCUMENTS = {
    "checkpoint/codec.py": "kubelet's checkpoint JSON, decoded into the typed Checkpoint",
    "doctor/textconf.py": "a TOML document as parsed, walked into dotted keys",
    "host/structconf.py": "YAML and TOML documents as parsed",
    "host/inventory.py": "the inventory file's JSON as parsed, read into Inventory",
    "host/kubeapi.py": "the API server's JSON answers as parsed, read into typed pods",
}
UNTYPED_ROWS_ALLOWED = {
    "engine/passguard.py:entry": "a journal entry's keyword arguments (level, fields)",
    "reporting/npd.py:monitor_config": "node-problem-detector's JSON config, shipped as is",
}


def _is_untyped_row(ann: ast.expr) -> bool:
    return any(
        isinstance(n, ast.Subscript)
        and isinstance(n.value, ast.Name)
        and n.value.id in ("dict", "Dict")
        and isinstance(n.slice, ast.Tuple)
        and [getattr(e, "id", None) for e in n.slice.elts] == ["str", "Any"]
        for n in ast.walk(ann)
    )


def untyped_row_signatures(source: str) -> list[str]:
    """Functions of `source` with dict[str, Any] in a parameter's or the return's
    annotation."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        annotations = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        annotations += [a.vararg.annotation if a.vararg else None, node.returns]
        annotations += [a.kwarg.annotation if a.kwarg else None]
        if any(ann is not None and _is_untyped_row(ann) for ann in annotations):
            bad.append(node.name)
    return bad


def _serialiser(name: str) -> bool:
    return name.startswith(SERIALISER_PREFIXES) or name.endswith(SERIALISER_SUFFIXES)


def untyped_rows_under_src() -> list[str]:
    """module:function of every signature with dict[str, Any], allowed or not."""
    return [
        f"{p.relative_to(SRC)}:{name}"
        for p in sorted(SRC.rglob("*.py"))
        for name in untyped_row_signatures(p.read_text())
    ]


def test_no_untyped_rows_in_signatures_outside_serialisation() -> None:
    bad = [
        where
        for where in untyped_rows_under_src()
        if not _serialiser(where.split(":")[1])
        and where.split(":")[0] not in PARSED_DOCUMENTS
        and where not in UNTYPED_ROWS_ALLOWED
    ]
    assert not bad, f"dict[str, Any] in a signature (a frozen dataclass instead): {bad}"


def test_every_untyped_row_exception_is_still_needed() -> None:
    found = untyped_rows_under_src()
    modules = {where.split(":")[0] for where in found}
    assert not set(PARSED_DOCUMENTS) - modules
    assert not set(UNTYPED_ROWS_ALLOWED) - set(found)


@pytest.mark.parametrize(
    "line",
    [
        "def f(x: dict[str, Any]) -> None: ...",
        "def f() -> Dict[str, Any]: ...",
        "def f(*, x: Optional[list[dict[str, Any]]] = None) -> None: ...",
        "async def f(**kw: dict[str, Any]) -> None: ...",
    ],
)
def test_the_untyped_row_check_catches_each_form(line: str) -> None:
    assert untyped_row_signatures(line) == ["f"]


def test_a_typed_mapping_is_no_untyped_row() -> None:
    assert untyped_row_signatures("def f(x: Mapping[str, int]) -> dict[str, object]: ...") == []
