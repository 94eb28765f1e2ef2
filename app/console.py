"""The run's console and log files: this project's lines on the console (above the progress bar), the
engines' (Ray, Serve, vLLM, DeepSpeed, transformers) only in RUN_DIR/logs/driver.log unless --verbose.

Where the engines' lines would come from, and where each is stopped when not verbose:
- the engines' loggers in this process: the root's console handler shows other libraries only at ERROR;
  DeepSpeed's logger prints through a stdout handler of its own, made when transformers (through accelerate)
  first imports deepspeed, and warns there that it picked the CPU: a filter on that logger sends its records
  below ERROR to driver.log;
- transformers' progress bars (tqdm, "Writing model shards" when the tiny model is built): turned off;
- the workers' stdout/stderr: not streamed here (`log_to_driver=False`, common/ray_utils.init_ray);
- what the raylet and the core workers publish to the driver (a raylet's "N worker processes have been
  started", "Task X failed ... killed by `ray.kill`" when a run's actors end): Ray prints it from a thread of
  its own; here it goes to the "ray" logger (driver.log);
- Ray's token-authentication notice: not raised (common/ray_connect.py sets the mode Ray would pick)."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from pathlib import Path

# Loggers of the engines in this (driver) process; quiet on the console unless --verbose, always in
# RUN_DIR/logs/driver.log.
ENGINE_LOGGERS = ("ray", "ray.serve", "ray.train", "ray.tune", "ray.data", "vllm", "DeepSpeed", "deepspeed",
                  "transformers", "torch", "filelock", "urllib3", "httpx")


# Every line the console shows by default: a log record ("HH:MM:SS message", the console handler's format), the
# progress bar ("GRPO RUN: ...", app/watch.py) and what the commands print (app/__main__.py).
OWN_LINE = re.compile(r"(\d\d:\d\d:\d\d |GRPO \S+:|(done|eval|plots|error|interrupted): |serving |published |"
                      r"each replica |REST front |stopping$)")


def is_own_line(line: str) -> bool:
    """Whether a console line is one of this project's formats (OWN_LINE), not an engine's."""
    return bool(OWN_LINE.match(line.strip()))


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


class _FileOnly(logging.Filter):
    """On an engine logger with a console handler of its own: records below ERROR go to driver.log only."""

    def __init__(self, console: Console):
        super().__init__()
        self.console = console

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if self.console.file is not None:
            self.console.file.handle(record)
        return False


_ray_printer = None  # Ray's own print of what is published to the driver, while _published_to_log replaces it


def _published_to_log(data: dict, ignore_prefix: bool = False) -> None:
    """Ray's print of what the raylet and core workers publish to the driver, as "ray.raylet" records: in
    driver.log while a console is open; after it closes (Ray's thread runs until the process exits) they stay
    in Ray's session logs only."""
    for line in data.get("lines", []):
        logging.getLogger("ray.raylet").warning("%s", line)


def _route_published(quiet: bool) -> None:
    global _ray_printer
    import ray._private.worker as ray_worker

    if quiet and _ray_printer is None:
        _ray_printer, ray_worker.print_to_stdstream = ray_worker.print_to_stdstream, _published_to_log
    elif not quiet and _ray_printer is not None:
        ray_worker.print_to_stdstream, _ray_printer = _ray_printer, None
    published = logging.getLogger("ray.raylet")
    published.handlers, published.propagate = [], True


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
        _route_published(quiet=not verbose)
        self._quiet = [] if verbose else self._quiet_engines()
        if logs_dir is not None:
            self.attach_file(logs_dir)

    def _quiet_engines(self) -> list:
        """Stop the engines' own console output at its source (module docstring); returns how to undo it."""
        from transformers.utils import logging as hf_logging

        undo = []
        hf_logging.disable_progress_bar()
        undo.append(hf_logging.enable_progress_bar)
        file_only = _FileOnly(self)
        deepspeed = logging.getLogger("DeepSpeed")
        deepspeed.addFilter(file_only)
        undo.append(lambda: deepspeed.removeFilter(file_only))
        return undo

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
        for undo in reversed(self._quiet):
            undo()
        self._quiet = []
        published = logging.getLogger("ray.raylet")  # published lines after the run: Ray's logs only
        published.handlers, published.propagate = [logging.NullHandler()], False
