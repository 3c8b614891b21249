"""The policy: alarms -> one coherent response per incident (escalation, recovery, LR guard, loss
tracking)."""
