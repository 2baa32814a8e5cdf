"""Offline rollout jobs: agents replaying multi-turn trajectories against a cluster as fast as it allows."""
