"""Sections sync, checkpoint, run, eval and env: how weights reach the engines, what is saved, how the run is
driven, logged and evaluated, and the multi-turn environment."""
from __future__ import annotations

from common.config.base import Section, broken, option
from common.config.choices import LoggerName, RunMode, SyncMode, words
from common.config.reasoning_gym import REASONING_GYM
from common.types import RUN_NAME

VERIFIERS_EVAL = "verifiers"  # eval.path: the held-out tasks of the run's verifiers environment (env.verifiers)


class SyncConfig(Section):
    section = "sync"
    mode: SyncMode = option("adapter", f"{words(SyncMode)}: publish LoRA tensors, or fold into base weights and "
                                       "push those.")
    every: int = option(1, "Publish every N optimizer steps.", ge=1)
    delta_threshold: float = option(0.0, "Skip a publish when no adapter tensor moved more than this (max abs).",
                                    ge=0)
    max_staleness: int = option(2, "Accept samples of versions >= trainer version - max_staleness (with "
                                   "rollout.partial, a group's version is the one it finished under).", ge=0)
    max_loras: int | None = option(None, "Adapter slots per replica; default and minimum: the live versions "
                                         "(max_staleness + 1), one to swap in the next, and one for the version "
                                         "under evaluation while eval.path is set (`Config.adapter_slots`).")
    overlap_publish: bool = option(True, "Async runs: hand the adapter to the registry in the background while the "
                                         "next step trains (a step costs max(learn, publish), not their sum); "
                                         "publishes stay in order, one in flight. Sync runs always wait.")

    @property
    def live_versions(self) -> int:
        """Versions the registry keeps live: the newest and the max_staleness before it, whose samples the
        trainer still accepts."""
        return self.max_staleness + 1

    def problems(self) -> list[str]:
        return broken(
            (self.every <= self.live_versions,
             f"sync.every: {self.every} publishes too rarely for sync.max_staleness {self.max_staleness}: samples of "
             f"the newest published version would already be stale; keep every <= {self.live_versions} "
             "(max_staleness + 1)"),
        )


class CheckpointConfig(Section):
    section = "checkpoint"
    every: int = option(10, "Checkpoint every N steps (0 = only at the end).", ge=0)
    keep: int = option(2, "Checkpoints Ray Train keeps.", ge=1)
    resume_from: str | None = option(None, "Checkpoint directory to resume from.")


class RunConfig(Section):
    section = "run"
    name: str = option("grpo", "Run name (subdirectory of out_dir).")
    out_dir: str = option("runs", "Where run directories go (metrics.jsonl, plots, adapter, checkpoints).")
    mode: RunMode = option("async", "async (rollouts run ahead) | sync (generate, then train, alternating).")
    serve_after: bool = option(False, "Keep serving the final policy after training until interrupted.")
    ray_address: str | None = option(None, "Ray address to join; null = the job's cluster or a new local one.")
    stall_timeout_s: float = option(600.0, "Fail the run (exit non-zero, with the buffer, registry and replica "
                                           "state) when no step finished and nothing was generated for this long.",
                                    gt=0)
    placement_timeout_s: float = option(
        300.0, "Stop the run (exit 1, one line naming what waits for which resources, resumable from its newest "
               "checkpoint) when no step finished and Ray could not place its train workers, Serve replicas or "
               "rollout workers for this long (a lost node, nothing to take its place). Longer than an autoscaler "
               "takes to add a node (minutes), shorter than run.stall_timeout_s so the clearer reason comes first.",
        gt=0)
    loggers: list[LoggerName] = option(
        ["jsonl"], f"Experiment trackers: any of {words(LoggerName, ', ')} (jsonl = metrics.jsonl, always on; "
                   "tensorboard -> RUN_DIR/tensorboard/; mlflow -> mlflow_tracking_uri; wandb offline in "
                   "RUN_DIR/wandb/ unless WANDB_API_KEY is set). pip install -e '.[tracking]' (tensorboard, mlflow) "
                   "or '.[wandb]'.")
    mlflow_tracking_uri: str | None = option(None, "MLflow tracking URI (e.g. http://host:5000); null = the file "
                                                   "store RUN_DIR/mlruns.")
    tracking_project: str = option("lora-grpo", "MLflow experiment / W&B project the run is logged under.",
                                   min_length=1)
    log_every: int = option(
        10, "Print one summary line (reward, eval, staleness, tokens/s, sync latency) every N steps "
            "on the console; Ray, Serve, vLLM and DeepSpeed logs go to RUN_DIR/logs/ "
            "(`train --verbose` streams them).", ge=1)
    fleet: str | None = option(
        None, "Train on a shared rollout fleet started by `python -m app fleet up --name NAME` instead of a "
              "service of the run's own (docs/FLEET.md); the run is served there as RUN_NAME/policy-vN. "
              "`train --fleet NAME` sets it.")
    fleet_weight: float = option(1.0, "The run's weight in the fleet's fair share of generated tokens.", gt=0)
    fleet_wait: bool = option(False, "When the fleet has too few free adapter slots, wait for them instead of "
                                     "failing at once (`train --wait`).")
    fleet_token: str | None = option(None, "The fleet's admin token, to attach; env LORA_GRPO_FLEET_TOKEN if null.")

    def problems(self) -> list[str]:
        return broken(
            (bool(self.name) and "/" not in self.name,
             f"run.name: {self.name!r} must be a non-empty name without '/'"),
            (self.fleet is None or bool(RUN_NAME.fullmatch(self.fleet)),
             f"run.fleet: {self.fleet!r} is not a fleet name (letters, digits, '_', '.', '-')"),
            (self.fleet is None or bool(RUN_NAME.fullmatch(self.name)),
             f"run.name: {self.name!r} names the run's adapters on the fleet (RUN/policy-vN): use letters, digits, "
             "'_', '.', '-' (at most 64)"),
        )


class EvalConfig(Section):
    section = "eval"
    path: str | None = option(
        None, "Held-out prompts scored during training through the served policy: a file or "
              "directory like data.path (same columns and reward), `builtin:letters-heldout` "
              "(letters prompts disjoint from `builtin:letters`), `reasoning-gym:TASK` (held-out items: "
              "another seed, never a training question; docs/TASKS.md), or `verifiers` (the env.verifiers "
              "environment's tasks under eval.args, never a training prompt; docs/VERIFIERS.md); null = no "
              "evaluation.")
    args: dict = option({}, "reasoning-gym eval.path: task config over the training one (default seed: the "
                            "data seed + 1000003; size: drawn as needed). eval.path verifiers: the taskset's "
                            "config over env.args (e.g. {seed: 1}, a split); default: env.args (an infinite "
                            "taskset's tasks after the training ones).")
    every: int = option(10, "Evaluate the version just published every N optimizer steps (also before step 1 and "
                            "after the last step); runs beside the rollouts, never stalls training.", ge=1)
    samples: int = option(64, "Eval prompts (the first N of eval.path).", ge=1)
    pass_k: int = option(1, "1 = pass@1, greedy (eval/accuracy); k > 1 also samples k completions per prompt at "
                            "grpo.temperature and reports eval/pass@k (any of the k correct).", ge=1)
    concurrency: int | None = option(
        None, "Eval prompts in flight at once. The engines' queues are full of rollouts while a run trains, so each "
              "wave of eval requests waits about one rollout turn: too few in flight and an eval outlasts many steps "
              "(8 took 55 s for 128 prompts on one GPU). null = a quarter of the replicas' vLLM slots "
              "(rollout.replicas x rollout.max_num_seqs / 4), at least 8.", ge=1)

    def problems(self) -> list[str]:
        return broken((self.path is None or bool(self.path.strip()), "eval.path: must be null or a path, got ''"),
                      (not self.args or (self.path or "").startswith(REASONING_GYM) or self.path == VERIFIERS_EVAL,
                       "eval.args: a reasoning-gym task's config (or, with eval.path verifiers, the taskset's "
                       "config); eval.path is neither reasoning-gym:TASK nor verifiers"))


class EnvConfig(Section):
    section = "env"
    cls: str | None = option(
        None, "Multi-turn environment `module:Class` (docs/MULTITURN.md): per episode `Class(row)`, then "
              "`reset() -> messages` and `step(assistant_text) -> {observations, reward, done}` (plain or async). "
              "null = single-turn: one prompt, one completion.")
    max_turns: int = option(4, "Assistant turns per episode at most; an episode still going then is truncated.", ge=1)
    max_episode_tokens: int | None = option(
        None, "Tokens per episode (prompt, every turn, every observation) at most; a turn that would pass it "
              "truncates the episode. null = model.max_model_len.", ge=2)
    step_timeout_s: float = option(60.0, "Seconds one reset() or step() may take; longer fails its episode.", gt=0)
    verifiers: str | None = option(
        None, "An installed verifiers environment id (docs/VERIFIERS.md): its taskset's tasks are the prompts, its "
              "@vf.reward functions (weighted sum) the reward, each one's score a step metric reward/NAME. "
              "pip install -e '.[envs]'. null = none.")
    args: dict = option({}, "Keyword arguments of the verifiers environment's taskset config (env.verifiers), "
                            "e.g. {size: 64}.")

    @property
    def episodic(self) -> bool:
        """Rollouts are episodes (app/episodes.py): a protocol class or a verifiers environment."""
        return self.cls is not None or self.verifiers is not None

    def problems(self) -> list[str]:
        return broken((self.cls is None or (":" in self.cls and all(self.cls.split(":", 1))),
                       f"env.cls: {self.cls!r} is not `module:Class`"),
                      (self.cls is None or self.verifiers is None,
                       "env.verifiers: set env.cls or env.verifiers, not both (each is the run's environment)"),
                      (self.verifiers is None or bool(self.verifiers.strip()),
                       "env.verifiers: must be null or an environment id, got ''"),
                      (not self.args or self.verifiers is not None,
                       "env.args: the verifiers environment's arguments need env.verifiers"))
