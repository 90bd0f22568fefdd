"""`gpuguard doctor`: is this node exposed to F1-F4, and why?

`facts.py` reads the host (through `paths.Root`) into frozen values, `judge.py` turns
them into one verdict per check, `model.py` holds the verdicts, their rendering and the
exit code. Nothing here writes.

Modules (docs/architecture.md has the map of the packages):

- `gpuguard doctor`: facts read from the host (`facts.py`; the kubelet and runtime keys
  it needs, flattened from real YAML and TOML parsers, `textconf.py` over
  `host/structconf.py`), pure judgement (`judge.py`), verdicts, their rendering and exit
  code (`model.py`), the inputs built and judged (`run.py`); kubelet's configuration as
  the running kubelet was told to read it, and the drop-in of the unit it runs in
  (`kubelet.py`)
"""
