"""The torch guard's machinery: sync modes, the deferred step and its skip gate, checkpoints,
feedback."""
