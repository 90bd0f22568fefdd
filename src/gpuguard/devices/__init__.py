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

Modules (docs/architecture.md has the map of the packages):

- kernel device-cgroup semantics (`rules.py`), NVIDIA nodes (one `DeviceNode` type and
  one directory lister, `list_dev_dir`, for the host's nodes, a container's and a device
  plugin's view, `nodes.py`; MIG capability minors, `caps.py`; `/dev/char` links,
  `devchar.py`), the kernel's verdict on an open from inside a cgroup (`probe.py`) on
  the fork, join and report skeleton of both probes (`cgroupchild.py`), container
  discovery (`kubepods.py`: the kubepods tree walked into its containers' cgroups, the
  directories that are no container kept as strays and a name with a control character
  refused; `containers.py`: each container's scope and the cgroup below it its process
  is in, crun's `SCOPE/container`; `cgrouptree.py`: a tree's directories and processes,
  followed a few levels down; the kubepods pod, QoS and container-scope name patterns of
  every driver and runtime in `cgroupnames.py`, used by the walk, the device plugin's
  process classification and the systemd source, with the one parser of
  `/proc/PID/cgroup`), entitlement (`entitlement.py`), PCI (`pci.py`); the device
  plugins, their sockets, serving processes and their `/dev` (`plugins.py`), who a pid
  is, whether it is still the same process, kubelet's pids (`processes.py`);
  `bpfprog.py`: cgroup v2 device programs of runc's/systemd's shape parsed into rules
  and built from them (pure); `bpfread.py`: the programs that bind a cgroup read back
  (each once), a v2 verdict judged from them without a fork, and the programs PID 1
  holds (systemd's, named or not)
- `kubeletproc.py`: where kubelet runs: its process (`kubelet`, or k3s's
  `k3s-agent`/`k3s-server`), the systemd unit its cgroup names, and its flags (k3s's
  `--kubelet-arg`); the checkpoint step restarts that unit, the doctor reads its
  configuration
- `kubelettrust.py`: the one place that decides which of those processes gpuguard acts
  for: in one of `[Systemd] KubeletUnits=`, run by root, from a root-owned executable at
  a kubelet/k3s/RKE2 install path; the others are `kubelet-process-untrusted` findings,
  never a unit to stop or a configuration to read
- `podnames.py`: a pod's namespace/name from the CRI annotations in its container's OCI
  bundle (containerd, CRI-O), for the command line
- `kubeletstart.py`: kubelet's start told by kubelet.sock's listener (SO_PEERCRED, its
  start since boot), else its inode, never its ctime: a touch, chown or xattr change is
  no start (the bridge and the device plugin step)
"""
