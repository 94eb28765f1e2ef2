"""Joining a Ray cluster the way a user starts one: `ray start --head` (Ray 2.60: token authentication on,
the token in ~/.ray/auth_token), then `RAY_ADDRESS=HOST:PORT python -m app fleet up|status|down` with nothing
else set. And a failed join says why: nothing at that address, no token, or the wrong one.

The cluster test owns its cluster: a HOME of its own (the token goes to its ~/.ray, not the user's), a Ray temp
dir of its own, free ports, and `ray start --head --block` as a child process, so terminating that process
stops exactly this cluster (`ray stop` has no address or temp-dir option: it stops every Ray on the machine).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from common.processes import end_process
from common.ray_connect import RayConnectError, connect_ray
from tests._serve_helpers import free_port

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def _app(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_no_cluster_at_the_address_says_so_at_once():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RayConnectError, match=rf"no Ray cluster at 127\.0\.0\.1:{port}: nothing answers") as e:
        connect_ray(f"127.0.0.1:{port}", start_local=False)
    assert f"ray start --head --port {port}" in str(e.value) and "RAY_ADDRESS" in str(e.value)
    assert time.monotonic() - started < 10  # ray.init alone retries for minutes here
    import ray

    assert not ray.is_initialized()


def test_fleet_command_without_a_cluster_names_the_address():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    r = _app(["fleet", "status", "--name", "x"], dict(env, RAY_ADDRESS=f"127.0.0.1:{free_port()}"), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"error: .*no Ray cluster at 127\.0\.0\.1:\d+ \(RAY_ADDRESS\)", r.stderr), r.stderr


@pytest.mark.slow
def test_readme_fleet_commands_on_a_token_auth_cluster(tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, capture_output=True, check=True, timeout=60)
    assert (home / ".ray" / "auth_token").is_file()  # the token a user's earlier local run left
    gcs, http = free_port(), free_port()
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={gcs}", "--num-cpus=1", f"--temp-dir={temp_dir}",
         "--include-dashboard=false", f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
         f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    user = dict(env, RAY_ADDRESS=f"127.0.0.1:{gcs}")  # all a user sets
    try:
        from common.ray_connect import probe_gcs

        deadline = time.monotonic() + 120
        while probe_gcs(f"127.0.0.1:{gcs}", timeout_s=2) == "unreachable":
            assert head.poll() is None, f"ray start --head exited:\n{head.stdout.read()}"
            assert time.monotonic() < deadline, "the head's GCS did not come up"
            time.sleep(1)
        assert probe_gcs(f"127.0.0.1:{gcs}") == "unauthenticated"  # token authentication is on

        wrong = _app(["fleet", "status", "--name", "shared"], dict(user, RAY_AUTH_TOKEN="0" * 32))
        assert wrong.returncode == 2 and "refused this process's Ray token (from RAY_AUTH_TOKEN)" in wrong.stderr, (
            wrong.stderr)
        none = _app(["fleet", "status", "--name", "shared"], dict(user, HOME=str(tmp_path)))
        assert none.returncode == 2 and "has token authentication on and this process has no Ray token" in (
            none.stderr), none.stderr

        up = _app(["fleet", "up", "--name", "shared", "--model", str(tiny_model_dir), "--replicas", "1", "--slots", "4",
                   "--port", str(http), "--set", "rollout.cpus_per_replica=0.5",
                   "--set", "rollout.proxy_location=HeadOnly"], user)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "fleet shared is up: 1 replicas" in up.stdout, up.stdout
        token = re.search(r"LORA_GRPO_FLEET_TOKEN=\.\.\.\): (\S+)", up.stdout).group(1)
        status = _app(["fleet", "status", "--name", "shared"], user)
        assert status.returncode == 0 and "fleet shared (Serve app fleet-shared)" in status.stdout, (
            status.stdout + status.stderr)
        assert "(no runs attached)" in status.stdout, status.stdout
        down = _app(["fleet", "down", "--name", "shared"], dict(user, LORA_GRPO_FLEET_TOKEN=token))
        assert down.returncode == 0 and "fleet shared is down" in down.stdout, down.stdout + down.stderr
    finally:
        end_process(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
