"""The monitor: metrics in, alarms and decisions out (binding, slot layout, fused step, replay,
state)."""
