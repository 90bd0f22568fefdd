"""What the daemon reports from its state: the ledger of step results, the `gpuguard
status` summary, node-problem-detector conditions and the Prometheus metrics."""
