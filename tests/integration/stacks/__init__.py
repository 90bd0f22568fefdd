"""The stacks fleets run, booted from Debian releases' own roots (test_stacks_f2.py)."""
