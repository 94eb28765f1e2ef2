"""`python -m app COMMAND`: the command line, every command's arguments parsed here; each command then
calls the module that does its job (app.driver for train, app.service for serve, app.evaluate for eval,
app.report, app.preflight, app.tiny_model, app.import_gguf, train_loops.merge, benchmarks/)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import Config

COMMANDS = {
    "train": "run async (or sync) LoRA GRPO: rollouts on vLLM replicas, training on Ray Train",
    "serve": "serve a model and optionally a saved adapter behind the OpenAI-compatible ingress",
    "merge": "fold a PEFT adapter into its base model, writing a standalone HF checkpoint",
    "tiny-model": "build the embedded tiny Qwen2 model (deterministic from a seed)",
    "validate": "load and validate a config (and its data and model) without starting anything",
    "bench": "run a benchmark from benchmarks/ (python -m app bench NAME [args])",
    "eval": "score a model or a saved adapter on held-out prompts through the served policy (accuracy, pass@k)",
    "report": "regenerate a run's plots and print its summary (finished, failed or still running)",
    "import-gguf": "convert a GGUF checkpoint once to an HF directory (safetensors, tokenizer, chat template)",
    "fleet": "a rollout fleet many runs share: fleet up | status | down --name NAME (train --fleet NAME attaches)",
}


def _top_help() -> str:
    lines = ["usage: python -m app COMMAND [options]", "", "commands:"]
    lines += [f"  {k:<11} {v}" for k, v in COMMANDS.items()]
    lines += ["", "`python -m app COMMAND --help` for each command's options."]
    return "\n".join(lines)


def _train_parser(prog: str, desc: str) -> argparse.ArgumentParser:
    from common.config import describe

    p = argparse.ArgumentParser(prog=prog, description=desc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="config keys (set in the YAML file or with --set section.key=value):\n"
                                       + describe())
    p.add_argument("--config", help="YAML config file (recipes/*.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key; VALUE is read as YAML (7, 1e-4, null, [a, b], {k: v}), else as text "
                        "(a judge template with ': ' in it stays text)")
    return p


def cmd_train(argv: list[str]) -> int:
    p = _train_parser("python -m app train", COMMANDS["train"])
    p.add_argument("--serve", action="store_true", help="keep serving the final policy after training (Ctrl-C stops)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true",
                   help="stream Ray, Serve, vLLM and DeepSpeed logs to the console (by default they go to "
                        "RUN_DIR/logs/ and Ray's session log directory)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR (stopped by Ctrl-C, killed, or stopped with exit 1 because the cluster "
                        "could no longer place it: run.placement_timeout_s) from its newest checkpoint, in RUN_DIR, "
                        "with its config.yaml (--set still overrides); every prompt of an epoch stays used once")
    p.add_argument("--fleet", metavar="NAME", help="roll out on the shared fleet NAME (`fleet up`) instead of a "
                                                   "service of the run's own; needs LORA_GRPO_FLEET_TOKEN")
    p.add_argument("--wait", action="store_true", help="with --fleet: wait for free adapter slots instead of "
                                                       "failing at once")
    args = p.parse_args(argv)
    if args.fleet:
        args.set = [*args.set, f"run.fleet={args.fleet}"] + (["run.fleet_wait=true"] if args.wait else [])
    from app import driver
    from app.data import DataError
    from app.fleet import FleetAttachError, FleetLeaseLost
    from app.resume import ResumeError, prepare_resume
    from app.watch import StallError
    from common.config import ConfigError, load
    from common.ray_connect import RayConnectError

    cfg = None
    try:
        if args.resume:
            if args.config:
                raise ResumeError("--resume takes the run's own config.yaml: leave out --config")
            cfg, resume = prepare_resume(args.resume, args.set)
        else:  # the run's directory named now, so an interrupted run's message below names the right one
            from app.preflight import free_run_name

            cfg, resume = free_run_name(load(args.config, args.set)), None
        if args.serve:
            cfg = cfg.replace(run={"serve_after": True})
        summary = driver.run(cfg, keep_serving=cfg.run.serve_after, progress=not args.no_progress,
                             verbose=args.verbose, resume=resume)
    except (ConfigError, DataError, FileNotFoundError, ResumeError, FleetAttachError, RayConnectError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (StallError, FleetLeaseLost) as e:  # incl. UnplaceableError, RestartsError: their line says how to resume
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        where = cfg.run_dir if cfg is not None else "RUN_DIR"
        print(f"interrupted: stopped at once; python -m app train --resume {where} continues from the last "
              "checkpoint", file=sys.stderr)
        return 130
    if summary.get("interrupted"):  # the driver said where it stopped and how to continue
        return 130
    from pathlib import Path

    run_dir = Path(summary["run_dir"])
    budget = (f" of {summary['total_steps']} (train.max_minutes {cfg.train.max_minutes:g} spent)"
              if summary.get("ended_by") == "train.max_minutes" else "")
    print(f"done: {summary['steps']}{budget} steps in {summary['wall_seconds']:.0f}s; reward "
          f"{summary['reward_first_quarter']:.3f} (first quarter) -> "
          f"{summary['reward_last_quarter']:.3f} (last quarter); "
          f"adapter {summary['adapter_dir']}; run dir {run_dir}")
    if "eval/accuracy" in summary:
        print(f"eval: accuracy {summary['eval_first']:.3f} (step {summary['eval_first_step']}) -> "
              f"{summary['eval/accuracy']:.3f} (step {summary['eval/step']}) on {summary['eval/samples']} held-out "
              f"prompts of {cfg.eval.path}" + "".join(f", {k.removeprefix('eval/')} {v:.3f}" for k, v in summary.items()
                                                   if k.startswith("eval/pass@")))
    print(f"plots: {run_dir / 'reward_curve.png'}; logs: {run_dir / 'logs'}; "
          f"python -m app report {run_dir}")
    if cfg.run.serve_after:
        import time

        from app.service import front_url

        url = front_url(cfg.rollout.app_name) or f"http://127.0.0.1:{cfg.rollout.http_port}/v1"
        print(f"serving policy-latest on {url} ; Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def cmd_validate(argv: list[str]) -> int:
    p = _train_parser("python -m app validate", COMMANDS["validate"])
    args = p.parse_args(argv)
    from app.data import DataError
    from common.config import ConfigError, load

    try:
        cfg = load(args.config, args.set)
        from app.preflight import preflight

        cfg, rows = preflight(cfg)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"ok: {len(rows)} prompts, model {cfg.model.path}, sync {cfg.sync.mode}, max_loras {cfg.replica_slots}")
    return 0


def cmd_tiny_model(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m app tiny-model", description=COMMANDS["tiny-model"])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="tiny", choices=["tiny", "small", "qwen2.5-1.5b"],
                   help="tiny: ~407k params, the CPU main job's; small: ~23M, pretrained on a GPU in a minute or "
                        "two, learns the letters task there; qwen2.5-1.5b: that body with its real vocabulary, "
                        "random weights, for speed work")
    args = p.parse_args(argv)
    from app.tiny_model import build_model_shape

    print(build_model_shape(args.out, args.shape, seed=args.seed))
    return 0


def cmd_merge(argv: list[str]) -> int:
    from train_loops.merge import main

    return main(argv)


def cmd_serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m app serve", description=(
        "Serve a model (and optionally a saved PEFT adapter as policy-v1 / policy-latest) behind the "
        "OpenAI-compatible ingress (prefix-aware routing) until interrupted."))
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--adapter", help="saved PEFT adapter directory, published as policy-v1")
    p.add_argument("--replicas", type=int, default=None, help="vLLM replicas (default rollout.replicas)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default rollout.http_port)")
    p.add_argument("--config", help="YAML config for the rest (engine, ingress and routing, admin token)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: running cluster or new local)")
    args = p.parse_args(argv)
    from app.service import serve_policy
    from common.adapter_io import AdapterError
    from common.config import ConfigError
    from common.ray_connect import RayConnectError

    sets = list(args.set) + [f"model.path={args.model}", "model.build_tiny=false"]
    if args.replicas is not None:
        sets.append(f"rollout.replicas={args.replicas}")
    if args.port is not None:
        sets.append(f"rollout.http_port={args.port}")
    try:
        cfg, payload = _config_and_adapter(args.config, sets, args.adapter)
    except (ConfigError, AdapterError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        serve_policy(cfg, payload, args.adapter, args.address)
    except RayConnectError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _config_and_adapter(config: str | None, sets: list[str], adapter: str | None
                        ) -> tuple[Config, tuple[dict, dict] | None]:
    """The config of `serve` and `eval`, and the adapter's (tensors, meta) payload (None without one).
    The adapter is read before anything starts, so a bad directory fails fast; its rank sets lora.rank."""
    from common.config import load
    from serve_deployments.app_builder import read_adapter_payload

    payload = None
    if adapter:
        payload, sets = read_adapter_payload(adapter, sets)
    return load(config, sets), payload


def cmd_bench(argv: list[str]) -> int:
    import runpy
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parent.parent / "benchmarks"
    scripts = {p.stem.removeprefix("bench_"): p for p in [*bench_dir.glob("bench_*.py"), *bench_dir.glob("gpu_*.py"),
                                                          bench_dir / "real_model.py", bench_dir / "rest_vs_vllm.py"]}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in scripts:
        print("usage: python -m app bench NAME [args]\nbenchmarks: " + ", ".join(sorted(scripts)))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib.util

    if importlib.util.find_spec("benchmarks") is None:  # a package of the repository, not of the install
        print(f"python -m app bench: run it from the repository root ({bench_dir.parent}): the benchmarks "
              "package is not importable from here", file=sys.stderr)
        return 2
    sys.argv = [scripts[argv[0]].name, *argv[1:]]
    runpy.run_module(f"benchmarks.{scripts[argv[0]].stem}", run_name="__main__", alter_sys=True)
    return 0


def cmd_eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m app eval", description=(
        "Score a model (or a saved PEFT adapter on it) on held-out prompts through the served policy: "
        "starts the service, runs the training-time evaluation once, prints accuracy, stops."))
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--adapter", help="saved PEFT adapter directory (served as policy-v1)")
    p.add_argument("--data", required=True, help="parquet/JSONL/dir like data.path, builtin:letters-heldout, "
                   "reasoning-gym:TASK, or verifiers (held-out tasks of the --config's env.verifiers)")
    p.add_argument("--samples", type=int, default=None, help="eval prompts (default eval.samples)")
    p.add_argument("--pass-k", type=int, default=None, help="also report pass@k (k samples at grpo.temperature)")
    p.add_argument("--config", help="YAML config for the rest (reward, columns, engine)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.add_argument("--verbose", action="store_true", help="stream Ray, Serve and vLLM logs")
    args = p.parse_args(argv)
    import json

    from app.data import DataError
    from app.evaluate import eval_rows, evaluate_service
    from common.adapter_io import AdapterError
    from common.config import ConfigError
    from common.ray_connect import RayConnectError

    sets = list(args.set) + [f"model.path={args.model}", "model.build_tiny=false", f"eval.path={args.data}",
                             "rollout.workers=1"]
    if args.samples is not None:
        sets.append(f"eval.samples={args.samples}")
    if args.pass_k is not None:
        sets.append(f"eval.pass_k={args.pass_k}")
    try:
        cfg, payload = _config_and_adapter(args.config, sets, args.adapter)
        rows = eval_rows(cfg)
    except (ConfigError, AdapterError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        metrics = evaluate_service(cfg, rows, payload, verbose=args.verbose)
    except RayConnectError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = f"{args.adapter} on {args.model}" if args.adapter else args.model
    if args.json:
        print(json.dumps(metrics))
    line = (f"eval: {what} on {args.data}: accuracy {metrics['eval/accuracy']:.3f} "
            f"({metrics['eval/samples']} prompts, greedy)")
    if cfg.eval.pass_k > 1:
        line += f", pass@{cfg.eval.pass_k} {metrics[f'eval/pass@{cfg.eval.pass_k}']:.3f}"
    print(line, flush=True)
    return 0


def cmd_report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m app report", description=COMMANDS["report"])
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (run.out_dir/run.name, e.g. runs/tiny-cpu)")
    p.add_argument("--no-plots", action="store_true", help="print the summary only")
    args = p.parse_args(argv)
    from app.report import report

    try:
        print(report(args.run_dir, plots=not args.no_plots))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_fleet(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m app fleet", description=COMMANDS["fleet"] + (
        ". The fleet lives on the Ray cluster (`ray start --head`) until `fleet down`; runs attach with "
        "`python -m app train --config FILE --fleet NAME` and the admin token `fleet up` prints."))
    p.add_argument("action", choices=["up", "status", "down"])
    p.add_argument("--name", required=True, help="the fleet's name (Serve app fleet-NAME)")
    p.add_argument("--model", help="up: HF model directory every run trains a LoRA adapter of")
    p.add_argument("--replicas", type=int, default=None, help="up: vLLM replicas (default rollout.replicas)")
    p.add_argument("--slots", type=int, default=None,
                   help="up: adapter slots per replica, shared by the runs (default sync.max_loras, else "
                        "8)")
    p.add_argument("--lease-s", type=float, default=30.0, help="up: a run that stops renewing is forgotten after "
                                                               "this many seconds")
    p.add_argument("--port", type=int, default=None, help="up: HTTP port (default rollout.http_port)")
    p.add_argument("--read-token", default=None, help="up: REST readers need this bearer token (default: "
                                                      "LORA_GRPO_FLEET_READ_TOKEN; none = open reading)")
    p.add_argument("--token", default=None, help="up/down: the admin token (default LORA_GRPO_FLEET_TOKEN; up "
                                                 "makes one when neither is set)")
    p.add_argument("--config", help="up: YAML config for the engines, ingress and replicas")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="up: config override")
    p.add_argument("--address", default=None, help="Ray cluster (default RAY_ADDRESS, else the running one)")
    p.add_argument("--json", action="store_true", help="status: print JSON")
    args = p.parse_args(argv)
    import json

    from app.fleet import DEFAULT_SLOTS, FleetAttachError, fleet_down, fleet_status, fleet_up, format_status
    from common.config import ConfigError, load

    try:
        if args.action == "up":
            if not args.model:
                raise ConfigError(["fleet up: --model DIR is required"])
            sets = list(args.set) + [f"model.path={args.model}", "model.build_tiny=false"]
            if args.replicas is not None:
                sets.append(f"rollout.replicas={args.replicas}")
            if args.port is not None:
                sets.append(f"rollout.http_port={args.port}")
            cfg = load(args.config, sets)
            slots = args.slots or cfg.sync.max_loras or DEFAULT_SLOTS
            cfg = load(args.config, sets + [f"sync.max_loras={slots}"])
            out = fleet_up(cfg, args.name, slots, args.lease_s, args.token, args.read_token, args.address)
            print(f"fleet {args.name} is up: {out['replicas']} replicas, {slots} adapter slots each, "
                  f"http://127.0.0.1:{out['http_port']}/v1")
            print(f"admin token (runs attach with it: export LORA_GRPO_FLEET_TOKEN=...): {out['admin_token']}")
            if out["read_token"]:
                print("REST readers need the read token (Authorization: Bearer ...)")
        elif args.action == "status":
            st = fleet_status(args.name, args.address)
            print(json.dumps(st, indent=1, default=str) if args.json else format_status(st))
        else:
            fleet_down(args.name, args.token, args.address)
            print(f"fleet {args.name} is down")
    except (ConfigError, FleetAttachError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_import_gguf(argv: list[str]) -> int:
    from app.import_gguf import main

    return main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--verbose" not in argv:
        # gRPC's C core writes INFO lines straight to stderr (past Python's logging), e.g. when the driver forks
        # HAProxy while Ray's threads are in gRPC: read once, when Ray first loads gRPC, so set it before that.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0
    cmd, rest = argv[0], argv[1:]
    fn = {"train": cmd_train, "serve": cmd_serve, "merge": cmd_merge, "tiny-model": cmd_tiny_model,
          "validate": cmd_validate, "bench": cmd_bench, "report": cmd_report,
          "eval": cmd_eval, "import-gguf": cmd_import_gguf, "fleet": cmd_fleet}.get(cmd)
    if fn is None:
        print(f"unknown command {cmd!r}\n\n{_top_help()}", file=sys.stderr)
        return 2
    return fn(rest)


if __name__ == "__main__":
    sys.exit(main())
