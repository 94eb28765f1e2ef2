"""Issue 20, goal 7: our REST endpoint against vLLM's own OpenAI server, same model, adapter and engine.

Both servers run at once, each with the engine arguments the replica gets (`engine_kwargs(cfg)`, its
environment `engine_env(cfg)`):
- REST: our service (Ray Serve: proxy -> Ingress -> one RolloutReplica), a random rank-8 LoRA published as
  policy-v1 through the adapter registry before the app starts (what `app serve --adapter` does);
- direct: the same replica's own REST port (`rollout.replica_http_port`, serve_deployments/replica_http.py:
  the same checks and names, in the engine's process, no routing);
- vLLM: `python -m vllm.entrypoints.openai.api_server` with those arguments as flags and the same adapter
  as `--lora-modules policy-v1=DIR`.
vLLM's own serving benchmark client (`vllm bench serve`, run in this process through
vllm.benchmarks.serve.main_async) loads one of them at a time: backend openai (/v1/completions) and
openai-chat (/v1/chat/completions), streaming, the random dataset (48 input, 32 output tokens, EOS ignored),
16 concurrent, 160 requests, model policy-v1. Rounds interleave the sides A B B A (the host drifts, and
shares its cores with other work); each pass's prompts are the round's (one seed per round, both sides
the same); the first round is a warm-up. A ratio is the median over rounds of REST / vLLM output tok/s
within the round. Each pass also records the CPU seconds every process of each side used, per request.

    python -m benchmarks.rest_vs_vllm [--smoke] [--rounds N] [--requests N] [--out DIR] [--work DIR]
                                      [--start-order together|after-kv|serial] [--direct-ingress]
    python -m benchmarks.rest_vs_vllm --finish OUT/rest_vs_vllm_gpu_partial.json
    python -m app bench rest_vs_vllm

Both servers start at once on CPU; on a GPU ours deploys once vLLM's server has allocated its KV cache
(--start-order, START_ORDERS). Before the passes, one small request per side and endpoint records its status and body
(`server_start_s.probes`): the client keeps only a failed request's HTTP reason. A pass whose requests
all fail stops the run, printing the dead actors' causes and the Serve logs' error lines. Stages and passes
are logged with their time as they happen, and OUT/rest_vs_vllm_{cpu|gpu}_partial.json is rewritten at each
stage and after each pass (the passes done, the stages, why it is partial), so a run killed by a time limit
leaves what it measured; a finished run removes it. The final document is written once the passes are done,
before the servers stop; a run killed while they stop, or in its last round, leaves a partial which `--finish` turns
into the final document from its complete rounds (at least 3).

Writes OUT/rest_vs_vllm_{cpu|gpu}.json (`rest_vs_vllm_serve_{cpu|gpu}`: the lower of the completions and
chat ratios through the Serve port; `..._replica_port`: the same through the replica's own port) and a PNG
beside it; prints a table. Server logs and the client's output stay in --work.
On a GPU machine (untested here) the replica and the vLLM server each get 0.4 of GPU 0 and the model is
the `qwen2.5-1.5b` shape.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The servers, the client's passes and what they share live in the _rest_vs_vllm_* modules; tests and
# benchmarks/probes/rest_latency.py still reach these names through this module (rv.VllmServer, rv.probe, ...).
from benchmarks._rest_vs_vllm_client import all_failed, client_argv, log_service_errors, one_pass, probe
from benchmarks._rest_vs_vllm_common import (
    ENDPOINTS,
    METRICS,
    REPO,
    SMOKE,
    WORKLOAD,
    Progress,
    _gpus,
    _jsonable,
    code_state,
    log,
    machine,
)
from benchmarks._rest_vs_vllm_servers import VllmServer, service_config, start_rest
from common.lora_payloads import make_lora_payload

SIDES = ("rest", "front", "vllm")  # --sides picks ours; vllm always last
SIDE_LABELS = {"rest": "our REST (Serve port: proxy -> Ingress -> replica)",
               "front": "our REST front (HAProxy -> replica port)",
               "direct": "our REST (replica port)", "vllm": "vLLM api_server"}
# A side's ratio keys: "{prefix}ratio" in a summary, "rest_vs_vllm_serve_{device}{suffix}" in the document.
PREFIX = {"rest": "", "front": "front_", "direct": "direct_"}
SUFFIX = {"rest": "", "front": "_front", "direct": "_replica_port"}
WHERE = {"rest": "Serve port", "front": "REST front", "direct": "replica port"}
GOAL = 0.9


def _ratio_text(x, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:.2f}{unit}"


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(rounds: list[dict]) -> dict:
    """Per endpoint: each side's medians over the measured rounds (all but the first), the ratio runs."""
    measured = rounds[1:] or rounds
    out = {}
    for ep in ENDPOINTS:
        sides = {}
        for side in SIDES:
            runs = [r[ep][side] for r in measured]
            sides[side] = {k: _median([x.get(k) for x in runs]) for k in METRICS}
            errors = collections.Counter()
            for x in runs:
                errors.update(x.get("errors") or {})
            if errors:
                sides[side]["errors"] = dict(errors.most_common(3))
            sides[side]["cpu_ms_per_request"] = {
                name: _median([x["cpu_ms_per_request"].get(name) for x in runs])
                for name in runs[0]["cpu_ms_per_request"]}
        out[ep] = sides
        for side in SIDES[:-1]:
            prefix = PREFIX[side]
            ratios = [r[ep][side]["output_tok_s"] / r[ep]["vllm"]["output_tok_s"] for r in measured
                      if r[ep][side]["output_tok_s"] and r[ep]["vllm"]["output_tok_s"]]
            ttft = [r[ep][side]["ttft_p50_ms"] / r[ep]["vllm"]["ttft_p50_ms"] for r in measured
                    if r[ep][side]["ttft_p50_ms"] and r[ep]["vllm"]["ttft_p50_ms"]]
            out[ep] |= {f"{prefix}ratio_runs": ratios, f"{prefix}ratio": _median(ratios),
                        f"{prefix}ttft_p50_ratio": _median(ttft)}
    return out


def table(summary: dict) -> str:
    head = f"{'endpoint':<12} {'side':<6} {'out tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9}"
    lines = [head, "-" * len(head)]
    for ep, s in summary.items():
        for side in SIDES:
            m = {k: v or 0 for k, v in s[side].items()}
            lines.append(f"{ep:<12} {side:<6} {m['output_tok_s']:>9.0f} {m['request_s']:>7.2f} "
                         f"{m['ttft_p50_ms']:>7.0f}ms {m['ttft_p99_ms']:>7.0f}ms {m['tpot_p50_ms']:>7.1f}ms")
        for side in SIDES[:-1]:
            prefix, what = PREFIX[side], WHERE[side]
            ratio = _ratio_text(s[prefix + "ratio"], "x")
            lines.append(f"{ep:<12} {'ratio':<6} {ratio:>10}  ({what} / vLLM output tok/s, runs "
                         + ", ".join(f"{r:.2f}" for r in s[prefix + "ratio_runs"]) + ")")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = list(ENDPOINTS)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "output_tok_s", "output tok/s (higher is better)"),
                           (axes[1], "ttft_p50_ms", "TTFT p50, ms (lower is better)")):
        for j, side in enumerate(SIDES):
            vals = [doc["endpoints"][ep][side][key] or 0 for ep in eps]
            bars = ax.bar([i + (j - (len(SIDES) - 1) / 2) * 0.27 for i in range(len(eps))], vals, 0.27,
                          label=SIDE_LABELS[side])
            for b, v in zip(bars, vals):
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(eps)), [f"{ep}\n" + "\n".join(
            f"{WHERE[side]} {_ratio_text(doc['endpoints'][ep][PREFIX[side] + 'ratio'], 'x')}" for side in SIDES[:-1])
            if key == "output_tok_s" else ep for ep in eps])
        ax.set_title(label, fontsize=9)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.35)  # room for the legend above the bars
        ax.legend(fontsize=7, loc="upper left")
    key = next(k for k in doc if k.startswith("rest_vs_vllm_serve_"))
    fig.suptitle(", ".join(f"{WHERE[side]} {_ratio_text(doc.get(key + SUFFIX[side]), 'x')}" for side in SIDES[:-1])
                 + f" of vLLM (goal >= {GOAL}); "
                 f"{doc['workload']['requests']} requests, "
                 f"{doc['workload']['concurrency']} concurrent, {doc['workload']['input_len']} in / "
                 f"{doc['workload']['output_len']} out tokens, streaming", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


START_ORDERS = {
    "together": "both launched at once",
    "after-kv": "vLLM's server launched, Ray started, our app deployed once that server's engine allocates its "
                "KV cache: vLLM sizes its KV cache from the GPU's free memory, so two engines profiling at once "
                "would count each other's memory",
    "serial": "vLLM's server ready first, then our service"}


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # the `finally`s run: partial document, servers stopped


def main(argv=None) -> int:
    global SIDES  # --sides: the module's functions read it
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help=f"fast check: {SMOKE}")
    p.add_argument("--rounds", type=int, default=None, help="rounds (the first a warm-up); default 4, smoke 2")
    p.add_argument("--requests", type=int, default=None, help="requests per pass; default 160, smoke 32")
    p.add_argument("--shape", default=None, help="model shape (default tiny on CPU, qwen2.5-1.5b on a GPU)")
    p.add_argument("--work", default=None, help="model, adapter and logs (default: a temp dir)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--sides", default="front",
                   help="our sides, each measured against vLLM's server: front (the REST front, rollout.front_port: "
                        "the endpoint `app serve` prints by default), rest (Serve's own port), direct (the replica's "
                        "own port); default %(default)s")
    p.add_argument("--direct-ingress", action="store_true",
                   help="Ray Serve's experimental direct ingress: the Ingress replica serves HTTP itself, no proxy hop")
    p.add_argument("--start-order", choices=list(START_ORDERS), default=None,
                   help="how the two servers start: " + "; ".join(f"{k}: {v}" for k, v in START_ORDERS.items())
                   + " (default after-kv on a GPU, together on CPU)")
    p.add_argument("--finish", metavar="PARTIAL", default=None,
                   help="write the final document (in PARTIAL's folder) from a partial one whose run was stopped "
                        f"before its document, from its complete rounds (at least {MIN_FINISH_ROUNDS}); runs nothing")
    args = p.parse_args(argv)
    if args.finish:
        try:
            finish_partial(Path(args.finish))
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--finish {args.finish}: {e}")
        return 0
    ours = [x.strip() for x in args.sides.split(",") if x.strip() and x.strip() != "vllm"]
    if not ours or set(ours) - set(PREFIX):
        p.error(f"--sides: choose from {', '.join(PREFIX)}, got {args.sides!r}")
    SIDES = (*ours, "vllm")
    w = WORKLOAD
    if args.smoke:
        w.update(SMOKE)
    w["rounds"] = args.rounds or w["rounds"]
    w["requests"] = args.requests or w["requests"]
    gpus = min(1, _gpus())
    device = "gpu" if gpus else "cpu"
    out, work = Path(args.out), Path(args.work or tempfile.mkdtemp(prefix="rest-vs-vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t_start, load_at_start, code = time.time(), list(os.getloadavg()), code_state()

    from app.tiny_model import ensure_model
    from common.adapter_io import write_peft_dir

    shape = args.shape or ("qwen2.5-1.5b" if gpus else "tiny")
    model = ensure_model(work / f"{shape}-model", shape=shape)
    tensors, meta = make_lora_payload(model, seed=1, rank=w["lora_rank"])
    adapter = write_peft_dir(tensors, meta["peft_config"], work / "adapter")
    cfg = service_config(model, gpus)
    # after-kv on a GPU: two engines must not profile the GPU's free memory at once. (The H200 failures of
    # 2026-12-04 blamed on it were the registry's death: start_rest let its handle go.) serial costs ~100 s.
    start_order = args.start_order or ("after-kv" if gpus else "together")
    passes = w["rounds"] * len(ENDPOINTS) * len(SIDES)
    progress = Progress(out / f"rest_vs_vllm_{device}_partial.json", {
        "command": "python -m benchmarks.rest_vs_vllm " + " ".join(argv), "workload": {**w, "shape": shape},
        "code": code, "work_dir": str(work), "load_avg_1_5_15_min_at_start": load_at_start},
        passes)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    progress.stage(f"model {shape} and a random rank-{w['lora_rank']} adapter in {work}; starting vLLM's "
                   f"api_server and our service (--start-order {start_order}) ...")
    starts = progress.starts
    starts["start_order"] = start_order
    rounds = progress.rounds
    server = front_watch = None
    try:
        server = VllmServer.for_engine(cfg, adapter, work / "vllm_server.log", on_event=progress.stage,
                                       log_kv=start_order == "after-kv")
        progress.base.update(vllm_server_cmd=server.cmd, vllm_server_env_extra=server.env_extra,
                             vllm_server_log=str(server.log_path))
        progress.stage(f"vLLM api_server launched (pid {server.proc.pid}, :{server.port}); starting our service: "
                       "Ray ...")
        t0 = time.time()
        gate = {"together": None, "after-kv": server.wait_kv, "serial": server.wait_ready}[start_order]

        def before_deploy():
            if gate is not None:
                t = time.time()
                progress.stage("our service: Ray up; waiting for vLLM's api_server "
                               + ("to allocate its KV cache" if gate == server.wait_kv else "to be ready"))
                gate()
                starts["rest_waited_for_vllm_s"] = time.time() - t

        def rest_progress(msg: str):
            progress.stage(msg)
            if server.error is not None:  # no use waiting on ours (wait_healthy says why every ~30 s)
                raise server.error

        ports, held = start_rest(cfg, (tensors, meta), before_deploy=before_deploy, progress=rest_progress,
                                 direct_ingress=args.direct_ingress, front="front" in SIDES)  # held until main returns
        front_watch = held[1]
        front_pid = front_watch.front._proc.pid if front_watch else None
        if "front" in SIDES and front_watch is None:
            SIDES = tuple(x for x in SIDES if x != "front")
            passes = progress.passes = w["rounds"] * len(ENDPOINTS) * len(SIDES)
        starts["rest_s"] = time.time() - t0
        ports["vllm"] = server.port
        progress.stage(f"REST service healthy on :{ports['rest']} ({starts['rest_s']:.0f}s after launch); "
                       f"replica port :{ports['direct']}" + (f", front :{ports['front']}" if "front" in ports else "")
                       + ("" if server.ready_s else "; waiting for vLLM's api_server"))
        server.wait_ready()
        starts["vllm_s"] = server.ready_s
        starts["both_ready_s"] = time.time() - t0
        progress.stage(f"both ready ({starts['both_ready_s']:.0f}s: vLLM {starts['vllm_s']:.0f}s, REST "
                       f"{starts['rest_s']:.0f}s); {w['rounds']} rounds x {len(ENDPOINTS)} endpoints x "
                       f"{len(SIDES)} sides, {w['requests']} requests each")
        probes = starts["probes"] = {f"{side} {ep}": probe(ports[side], ep) for side in SIDES for ep in ENDPOINTS}
        bad = {k: v for k, v in probes.items() if v["status"] != 200}
        progress.stage("probe requests: " + ("every side answered 200" if not bad else "; ".join(
            f"{k}: {v['status']} {v['body'][:600]}" for k, v in bad.items())))
        if bad:
            log_service_errors()
        with open(work / "client.log", "w") as client_log:
            for r in range(w["rounds"]):
                order = SIDES if r % 2 == 0 else SIDES[::-1]
                row = {"order": list(order)}
                rounds.append(row)  # filled pass by pass: the partial document has the passes done so far
                for ep in ENDPOINTS:
                    row[ep] = {}
                    for side in order:
                        what = f"round {r + 1}/{w['rounds']}{' (warm-up)' if r == 0 else ''} {ep:<11} {side:<6}"
                        progress.stage(f"{what}: pass {progress.passes_done() + 1}/{passes} ...")
                        res = one_pass(side, ep, ports, server, model, w["requests"], seed=r, log_file=client_log,
                                       front_pid=front_pid)
                        row[ep][side] = res
                        progress.stage(f"{what}: {res['output_tok_s'] or 0:6.0f} tok/s, TTFT p50 "
                                       f"{res['ttft_p50_ms'] or 0:5.0f} ms, {res['completed']}/{w['requests']} ok")
                        if (why := all_failed(res)) is not None:  # no use running the other passes
                            log_service_errors()
                            raise RuntimeError(f"{what.strip()}: {why}")
        # The document before the servers stop: stopping Ray and Serve took over a minute on the H200, and a time
        # limit there once killed a run with every pass done and no document (finish_partial mends that case).
        from serve_deployments.engine_config import engine_kwargs

        settings = {"engine_kwargs": engine_kwargs(cfg), "engine_env": server.env, "vllm_server_cmd": server.cmd,
                    **({"vllm_server_env_extra": server.env_extra} if server.env_extra else {}),
                    "rest": {"replicas": 1, "router_policy": cfg.router.policy,
                             "ingress": ("Ray Serve direct ingress (the Ingress replica listens; no proxy)"
                                         if args.direct_ingress else "Ray Serve's HTTP proxy -> Ingress"),
                             "auth": "none: a standalone service's REST reads need no token (only /admin does)",
                             **({"stream_interval_ms": cfg.rollout.stream_interval_ms}
                                if hasattr(cfg.rollout, "stream_interval_ms") else {})},
                    "server_start_s": starts}
        doc = final_document(rounds, device, model, {
            "machine": machine(load_at_start), "code": code, "command": "python -m benchmarks.rest_vs_vllm "
            + " ".join(argv), "workload": {**w, "shape": shape}, "settings": settings,
            "wall_s": time.time() - t_start, "work_dir": str(work)})
        write_final(doc, out, device)
        progress.path.unlink(missing_ok=True)  # the final document has it all
    except BaseException as e:  # a signal's SystemExit and Ctrl-C too: the partial document says why it stopped
        progress.write(f"stopped after {progress.passes_done()} of {passes} passes: {type(e).__name__}: {e}",
                       vllm_server_log_tail=server.log_tail() if server else "")
        raise
    finally:
        import ray
        from ray import serve

        if server is not None:
            server.close()
        if front_watch is not None:
            front_watch.stop()
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
    return 0


def final_document(rounds: list[dict], device: str, model: Path, fields: dict) -> dict:
    """The goal keys (each side's lower endpoint ratio), the per-endpoint summary, the rounds and `fields`."""
    summary = summarize(rounds)
    key = f"rest_vs_vllm_serve_{device}"
    doc = {"goal": f">= {GOAL}"}
    for side in SIDES[:-1]:
        r = PREFIX[side] + "ratio"
        worst = min(ENDPOINTS, key=lambda ep: summary[ep][r] if summary[ep][r] is not None else -1)
        doc[key + SUFFIX[side]] = summary[worst][r]
        doc[key + SUFFIX[side] + "_is"] = (f"the lower of the completions and chat ratios ({worst}): "
                                           f"{SIDE_LABELS[side]} / vLLM output tok/s")
        doc["met" + SUFFIX[side]] = summary[worst][r] is not None and summary[worst][r] >= GOAL
    w = fields["workload"]
    doc |= {
        "endpoints": summary, "rounds": rounds,
        "method": f"both servers alive, passes interleaved A B B A over {w['rounds']} rounds (the first a warm-up), "
                  "one endpoint at a time; a ratio is the median over the measured rounds of REST / vLLM within "
                  "the round; one client seed per round (both sides get the same prompts)",
        **fields}
    doc.setdefault("settings", {})["client"] = "vllm bench serve " + " ".join(
        client_argv("completions", 0, model, w["requests"], 0))
    return doc


def write_final(doc: dict, out: Path, device: str) -> Path:
    """OUT/rest_vs_vllm_{device}.json, its plot, the table and the goal line."""
    f = out / f"rest_vs_vllm_{device}.json"
    f.write_text(json.dumps(doc, indent=2, default=_jsonable))
    try:
        plot(doc, f.with_suffix(".png"))
    except Exception as e:  # a missing matplotlib must not lose the numbers
        log(f"plot failed: {e}")
    print(table(doc["endpoints"]))
    key = f"rest_vs_vllm_serve_{device}"
    log(", ".join(f"{key}{SUFFIX[side]} = {_ratio_text(doc[key + SUFFIX[side]])}" for side in SIDES[:-1])
        + f" (goal >= {GOAL}); wrote {f} and {f.with_suffix('.png').name}")
    return f


MIN_FINISH_ROUNDS = 3


def finish_partial(partial: Path) -> Path:
    """The final document from a partial one that a run left behind: killed while its servers stopped (every pass
    done), or in its last rounds. The summary is a finished run's, over the rounds in which every side ran on
    every endpoint (a cut round is dropped whole: its sides ran in one order against one host state); a cut run
    needs MIN_FINISH_ROUNDS of them. The partial stays, as the record of the stop."""
    global SIDES
    doc = json.loads(partial.read_text())
    rounds = doc.get("rounds") or []
    ours = [s for s in rounds[0]["order"] if s != "vllm"] if rounds else []
    complete = [r for r in rounds
                if all(all(side in r.get(ep, {}) for side in (*ours, "vllm")) for ep in ENDPOINTS)]
    every_pass = bool(rounds) and doc.get("passes_done") == doc.get("passes") and len(complete) == len(rounds)
    if not every_pass and len(complete) < MIN_FINISH_ROUNDS:
        raise ValueError(f"{partial}: {len(complete)} complete round(s) ({doc.get('passes_done')} of "
                         f"{doc.get('passes')} passes were done); --finish needs {MIN_FINISH_ROUNDS} (the first is "
                         "a warm-up, the ratio a median of the others)")
    SIDES = (*sorted(ours, key=list(PREFIX).index), "vllm")
    device = "gpu" if partial.name.endswith("_gpu_partial.json") else "cpu"
    fields = {k: doc[k] for k in ("code", "command", "workload", "work_dir", "load_avg_1_5_15_min_at_start",
                                  "wall_s") if k in doc}
    fields |= {"settings": {"vllm_server_cmd": doc.get("vllm_server_cmd"), "server_start_s": doc.get("server_start_s")},
               "finished_from_partial": {"file": partial.name, "reason": doc.get("partial_reason"),
                                         "updated_at": doc.get("updated_at"),
                                         "passes_done": doc.get("passes_done"), "passes": doc.get("passes"),
                                         "rounds_used": len(complete), "rounds_cut": len(rounds) - len(complete)}}
    model = Path(doc.get("work_dir") or ".") / f"{doc['workload'].get('shape', 'tiny')}-model"
    return write_final(final_document(complete, device, model, fields), partial.parent, device)

if __name__ == "__main__":
    sys.exit(main())
