"""What the monitor writes for people and tools: event log, alert sinks, handlers, Prometheus, W&B,
feedback metrics."""
