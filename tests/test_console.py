"""The console's quiet mode stops the engines' own output where it starts, in this process (no Ray cluster:
Ray's printer of published lines is called as its listener thread calls it): DeepSpeed's logger with a stdout
handler of its own, transformers' progress bars, and the raylet's lines Ray prints from its error pubsub. Each
goes to RUN_DIR/logs/driver.log instead; --verbose leaves them on the console."""
from __future__ import annotations

import logging
import sys

import pytest

from app.console import Console, is_own_line


@pytest.fixture
def deepspeed_logger():
    """A logger set up the way deepspeed.utils.logging sets up "DeepSpeed" (own stdout handler, no propagation),
    restored afterwards."""
    lg = logging.getLogger("DeepSpeed")
    saved = lg.handlers, lg.propagate, lg.level
    yield lg
    lg.handlers, lg.propagate, lg.level = saved


def _engine_lines(console: Console, deepspeed_logger: logging.Logger) -> None:
    import ray._private.worker as ray_worker
    from transformers.utils import logging as hf_logging

    deepspeed_logger.handlers = [logging.StreamHandler(sys.stdout)]  # added at deepspeed's import, after ours
    deepspeed_logger.propagate = False
    deepspeed_logger.setLevel(logging.WARNING)
    deepspeed_logger.warning("Setting accelerator to CPU.")
    for _ in hf_logging.tqdm(range(2), desc="Writing model shards"):
        pass
    ray_worker.print_to_stdstream({"lines": ["WARNING: 10 PYTHON worker processes have been started"],
                                   "pid": "raylet", "is_err": False}, ignore_prefix=False)
    logging.getLogger("app").info("step 1/2 | reward 0.5")


def test_quiet_console_sends_engine_lines_to_driver_log(tmp_path, capfd, deepspeed_logger):
    console = Console(tmp_path, verbose=False)
    try:
        _engine_lines(console, deepspeed_logger)
    finally:
        console.close()
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).replace("\r", "\n").splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith("step 1/2 | reward 0.5") and is_own_line(lines[0]), lines
    log = (tmp_path / "driver.log").read_text()
    assert "Setting accelerator to CPU." in log and "10 PYTHON worker processes" in log, log
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # close() gave the bars back


def test_verbose_console_shows_them(tmp_path, capfd, deepspeed_logger):
    console = Console(tmp_path, verbose=True)
    try:
        _engine_lines(console, deepspeed_logger)
    finally:
        console.close()
    out, err = capfd.readouterr()
    both = out + err
    assert "Setting accelerator to CPU." in both and "Writing model shards" in both, both
    assert "10 PYTHON worker processes" in both, both
