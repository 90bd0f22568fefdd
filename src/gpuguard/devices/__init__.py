"""GPU device access (F2/F3): device cgroup semantics, NVIDIA nodes, GPU containers.

Modules, from the bottom up:

- ``rules``: the kernel's cgroup v1 devices semantics (parse, evaluate, simulate writes);
- ``nodes``: NVIDIA device nodes, their majors from /proc/devices, /dev/char links;
- ``containers``: GPU container cgroups under kubepods (v1 / v2, systemd / cgroupfs);
- ``entitlement``: which nodes a container was given (never more);
- ``audit``: pure findings + actions from the above and observed access verdicts;
- ``probe``: the kernel's own verdict, by opening a node from inside a cgroup;
- ``cgroupio``: the few cgroup file reads/writes the above need.

Nothing here is wired into the daemon; observe/reconcilers/actuate import from here.
"""
