"""The run around the monitor: checkpoint ledger, checkpoint cadence, goodput, stall watchdog,
preemption."""
