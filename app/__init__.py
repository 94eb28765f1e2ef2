"""Driver side: CLI, registry, buffer, rollout workers, data, rewards, metrics."""
