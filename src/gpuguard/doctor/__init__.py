"""`gpuguard doctor`: is this node exposed to F1-F4, and why?

`facts.py` reads the host (through `paths.Root`) into frozen values, `judge.py` turns
them into one verdict per check, `model.py` holds the verdicts, their rendering and the
exit code. Nothing here writes.
"""
