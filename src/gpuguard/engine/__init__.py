"""The daemon's engine: the loop and its signals, the coalescer, what a pass is made of,
the host snapshot a pass decides from, the one-shot runs, operator hooks."""
