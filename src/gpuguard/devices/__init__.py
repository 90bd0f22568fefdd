"""GPU device access (F2/F3): device cgroup semantics, NVIDIA nodes, GPU containers.

Modules, from the bottom up:

- ``rules``: the kernel's cgroup v1 devices semantics (parse, evaluate, simulate writes);
- ``nodes``: NVIDIA device nodes, their majors from /proc/devices, /dev/char links;
- ``containers``: GPU container cgroups under kubepods (v1 / v2, systemd / cgroupfs);
- ``entitlement``: which nodes a container was given (never more);
- ``probe``: the kernel's own verdict, by opening a node from inside a cgroup;
- ``pci``: GPUs on the PCI bus.

Nothing here is wired into the daemon; the steps (``steps/<name>/``) import from here.
The container access judgement and its cgroup writes live with their step
(``steps/container_access/reconcile.py``, ``actuate.py``).
"""
