"""Sequence parallelism: ring attention over a mesh axis, chosen by the contract for sequence-sharded inputs."""
