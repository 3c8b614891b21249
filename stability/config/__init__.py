"""Configuration: the config dataclasses and loading, the detector registry and the presets."""
