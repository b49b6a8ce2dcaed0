"""Scan rules for configuration: attention-implementation switches, config flags, environment variables."""
