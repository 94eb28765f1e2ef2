"""Cluster set-up files: KubeRay manifests and the job runtime environment (YAML, not code)."""
