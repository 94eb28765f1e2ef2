"""The run's console and log files: this project's lines on the console (above the progress bar), the
engines' (Ray, Serve, vLLM, DeepSpeed, transformers) only in RUN_DIR/logs/driver.log unless --verbose."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path

# Loggers of the engines in this (driver) process; quiet on the console unless --verbose, always in
# RUN_DIR/logs/driver.log.
ENGINE_LOGGERS = ("ray", "ray.serve", "ray.train", "ray.tune", "ray.data", "vllm", "DeepSpeed", "deepspeed",
                  "transformers", "torch", "filelock", "urllib3", "httpx")


class _TqdmHandler(logging.StreamHandler):
    """Console log lines written above the progress bar (tqdm.write), so the bar stays one line."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _QuietFilter(logging.Filter):
    """On the console: this project's INFO lines; other libraries' only at ERROR (their INFO and WARNING
    lines are in RUN_DIR/logs/driver.log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name in ("app", "__main__") or record.name.startswith(("app.", "common", "train_loops",
                                                                               "serve_deployments"))
        return record.levelno >= (logging.INFO if ours else logging.ERROR)


class Console:
    """The run's console and log files: console lines go through tqdm (above the bar), filtered unless
    verbose; RUN_DIR/logs/driver.log gets every record of this process (INFO and up, engines included).
    `close()` restores the logging setup it found and links Ray's session logs into RUN_DIR/logs/ray."""

    def __init__(self, logs_dir: Path | None, verbose: bool = False):
        self.verbose, self.logs_dir = verbose, logs_dir
        root = logging.getLogger()
        self._saved = (root.level, list(root.handlers), {name: (logging.getLogger(name).level,
                                                                 logging.getLogger(name).propagate)
                                                          for name in ENGINE_LOGGERS})
        fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        console = _TqdmHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S") if not verbose else fmt)
        if not verbose:
            console.addFilter(_QuietFilter())
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=FutureWarning)
        self._fmt, self.file, self.console = fmt, None, console
        # Ray and Serve install their own console handlers on import (Serve's logs every app start and
        # delete at INFO): imported now, so those handlers are taken over below.
        import ray  # noqa: F401
        import ray.serve  # noqa: F401

        # Ray's own records stop at the "ray" logger (ray.init puts its LoggingConfig handler on the root):
        # console at ERROR unless verbose, driver.log at INFO.
        self.ray_console = _TqdmHandler(sys.stderr)
        self.ray_console.setFormatter(fmt)
        self.ray_console.setLevel(logging.INFO if verbose else logging.ERROR)
        root.handlers = [console]
        root.setLevel(logging.INFO)
        for name in ENGINE_LOGGERS:  # one path for every record: the root's handlers (Ray's: the "ray" logger's)
            lg = logging.getLogger(name)
            lg.handlers, lg.propagate = [h for h in lg.handlers if not isinstance(h, logging.StreamHandler)], True
            lg.setLevel(logging.INFO if verbose or name.startswith("ray") else logging.WARNING)
        self._route_ray()
        if logs_dir is not None:
            self.attach_file(logs_dir)

    def _route_ray(self) -> None:
        lg = logging.getLogger("ray")
        lg.handlers = [h for h in (self.ray_console, self.file) if h is not None]
        lg.propagate = False
        lg.setLevel(logging.INFO)

    def attach_file(self, logs_dir: Path) -> None:
        """Every record of this process (INFO and up, engines included) also goes to logs_dir/driver.log."""
        self.logs_dir = logs_dir
        logs_dir.mkdir(parents=True, exist_ok=True)
        self.file = logging.FileHandler(logs_dir / "driver.log")
        self.file.setFormatter(self._fmt)
        logging.getLogger().addHandler(self.file)
        self._route_ray()
        logging.captureWarnings(True)

    def adopt_ray_loggers(self) -> None:
        """ray.init (its LoggingConfig) reconfigures the root logger and Ray's loggers: ours again."""
        root = logging.getLogger()
        root.handlers = [self.console] + ([self.file] if self.file is not None else [])
        root.setLevel(logging.INFO)
        for name in ENGINE_LOGGERS:
            lg = logging.getLogger(name)
            if name.startswith("ray."):
                lg.handlers = [h for h in lg.handlers if not isinstance(h, logging.StreamHandler)]
                lg.propagate = True
                lg.setLevel(logging.INFO)
        self._route_ray()

    def close(self) -> None:
        if self.logs_dir is not None:
            with contextlib.suppress(Exception):
                import ray

                src = Path(ray._private.worker._global_node.get_logs_dir_path())  # this session's logs
                link = self.logs_dir / "ray"
                if link.is_symlink() and Path(os.readlink(link)) != src:  # a resumed run: keep the earlier one
                    index = 1
                    while (self.logs_dir / f"ray-{index}").exists() or (self.logs_dir / f"ray-{index}").is_symlink():
                        index += 1
                    link.rename(self.logs_dir / f"ray-{index}")
                if src.is_dir() and not link.exists():
                    link.symlink_to(src, target_is_directory=True)
            with contextlib.suppress(Exception):
                self.file.close()
            logging.captureWarnings(False)
        root = logging.getLogger()
        level, handlers, loggers = self._saved
        root.handlers, root.level = handlers, level
        for name, (_, prop) in loggers.items():  # levels stay as set: atexit hooks (torch) log after this
            logging.getLogger(name).propagate = prop
        logging.getLogger("ray").handlers = [self.ray_console]
