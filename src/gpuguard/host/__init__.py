"""Access to the host: the root prefix every path goes through, the one bounded reader,
numbers read from files, external commands, the systemd D-Bus client, sd_notify and the
GPU inventory (NVML or a file).

Modules (docs/architecture.md has the map of the packages):

- the root prefix (`paths.py`); the one reader of files others control: non-blocking, no
  links unless asked, regular files only, a size cap per kind (`safeio.py`); the one
  parser of decimal integers from files and bounded echoes of values (`numparse.py`);
  the one function every external command goes through (`commands.py`); the D-Bus
  client, calls bounded in flight (64), every reply checked (`systemd.py`); sd_notify
  without libsystemd (`notify.py`); one unary gRPC call over a unix socket with HTTP/2
  spoken by hand, kubelet's podresources API for the device plugin step, without
  grpcio's 10-14 MB in the daemon (`unarygrpc.py`); protobuf's varints and
  length-delimited fields, for that answer, the re-admission bridge's messages and a
  checkpoint entry's AllocResp (`protowire.py`); the C library, looked up once
  (`libc.py`); inotify's flags, watches and events (`inotify.py`); the daemon's memory
  handed back to the kernel after passes, a full collection then `malloc_trim`, and
  glibc's mmap threshold fixed (`memtrim.py`); the daemon's few worker threads
  (`workers.py`); the GPU inventory, NVML or a file (`inventory.py`); the calling
  thread's time on a CPU and waiting for one, the reload fast path's figures
  (`threadclock.py`); asyncio locks and events made at their first use inside the
  running loop, so objects built before it work on Python 3.9 (`aio.py`)
- `safeio.py`: the one reader of files others control: non-blocking, no links unless
  asked, regular files only, a cap per kind bounded by the bytes read (sysfs reports
  4096, procfs 0: `read_attr` reads one kernel attribute), in requests that start at 16
  KiB and grow only while filled (a request allocates its whole size first);
  `tests/unit/test_layout.py` fails on any other open, read or parse of a file under
  `src/`, with an explicit list of the few modules allowed and why, and
  `tests/unit/test_real_sysfs.py` reads this machine's real `/sys` through it
- `statefile.py` (the loader) with `actuate/statefile.py` (the writer): gpuguard's own
  state files: one `StateFile` per file (path, version, a parser into frozen dataclasses
  through typed field getters, a renderer), one loader (`load`: the value, or absent, or
  one line why; bounded numbers, no runaway nesting, lone surrogates replaced) and one
  writer (`write_state`, atomic, in a checked directory); the status file
  (`reporting/status.py`), metrics.json (`reporting/metrics_file.py`), the hook's
  request and result and its memo, the dropped-entries record and the device plugin's
  budgets each have one
- `numparse.py`, `echo.py`: the one parser of decimal integers from files (ASCII digits,
  bounded length, range); the one way an outside value appears in a message (`cut`,
  `clip`: control characters escaped, length bounded), used by the journal, the one
  error line, findings, doctor and the configuration's did-you-mean
- `structconf.py`: other programs' YAML and TOML through real parsers (PyYAML; tomllib
  or tomli), bounded (1 MiB, nesting measured on libyaml's event stream before its
  recursive composer runs), a refusal with its reason instead of a guess
- `offswitch.py` (read) with `actuate/offswitch.py`, `cli/switch.py`,
  `engine/operation.py`: the off switch `/etc/gpuguard/disabled`: read (anything at the
  path is "off"), written and removed (`gpuguard disable`/`enable`), and how the daemon
  obeys it (checked before every pass and fast path: it stops, nothing more is written)
  and journals observe-only mode
- `pathtrust.py`: a path only root controls, every directory down to it and through its
  links checked, for what gpuguard loads or believes (NVML's library, the podresources
  socket, kubelet's executable); `commands.run_as_nobody` runs such a file as nobody
  without new privileges
- `hpack.py`: RFC 7541's HPACK decoder, for the gRPC answers' grpc-status and
  grpc-message (`unarygrpc.py`)
- `kubeapi.py`: the re-admission bridge's read-only Kubernetes API client, with
  kubelet's kubeconfig, the standard library's TLS, every call bounded in time and
  size, its answer as frozen rows
"""
