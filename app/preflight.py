"""Everything checked or decided before a run starts its actors: the model, the data and its columns,
lora.target_modules (`preflight`, also `python -m app validate`); the run directory (`make_run_dir`);
whether the cluster can place the run (`check_fits`, once Ray is up)."""
from __future__ import annotations

import logging
from pathlib import Path

import yaml

from app.resume import Resume
from common.config import VERIFIERS_EVAL, Config, ConfigError, needs_merge

logger = logging.getLogger("app")


def preflight(cfg: Config) -> tuple[Config, list[dict]]:
    """Everything that can fail before an actor starts: model dir, data and columns, target modules.
    Returns the config to run (merge sync where vLLM cannot serve the adapter) and the training prompts."""
    from app.data import load_prompts
    from app.reasoning_gym_tasks import is_reasoning_gym
    from app.tiny_model import ensure_model

    if (reason := needs_merge(cfg)) and cfg.sync.mode == "adapter":
        logger.warning("sync.mode=adapter but %s: falling back to merge mode (full weights each publish)", reason)
        cfg = cfg.replace(sync={"mode": "merge"})
    ensure_model(cfg.model.path, cfg.model.build_tiny, cfg.model.tiny_seed, cfg.model.tiny_shape)
    rows = load_prompts(cfg.data) if cfg.env.verifiers is None else verifiers_prompts(cfg)
    if is_reasoning_gym(cfg.eval.path) or cfg.eval.path == VERIFIERS_EVAL:
        from app.evaluate import eval_rows  # a bad eval task or too few held-out ones fail here, not mid-run

        eval_rows(cfg)
    check_target_modules(cfg)
    if cfg.env.cls:
        check_episodes(cfg, rows[0])
    return cfg, rows


def check_episodes(cfg: Config, row: dict) -> None:
    """A multi-turn run's environment on its first data row (it loads, builds and resets into chat
    messages), and the chat template appending turns token-exactly: one ConfigError naming env.cls
    before any engine starts."""
    from transformers import AutoTokenizer

    from app.chat_tokens import ChatTokens, TemplateError
    from app.envs import check_env, load_env

    try:
        check_env(cfg.env.cls, row, cfg.env.step_timeout_s)
        env = load_env(cfg.env.cls)(row)
        chat = ChatTokens(AutoTokenizer.from_pretrained(cfg.model.path), tools=getattr(env, "tools", None))
        chat.suffix([{"role": "user", "content": "x"}])
    except TemplateError as e:
        raise ConfigError([f"env.cls: {e}"]) from None
    except ValueError as e:
        raise ConfigError([str(e)]) from None


def verifiers_prompts(cfg: Config) -> list[dict]:
    """A verifiers environment's tasks as the prompts (app/verifiers_env.py), its first episode built and reset:
    one ConfigError naming env.verifiers (not installed, unknown id, no tasks, no rubric) before any engine."""
    from app.envs import check_messages
    from app.verifiers_env import VerifiersError, first_prompt, verifiers_rows

    try:
        rows = verifiers_rows(cfg.env, cfg.data.builtin_size)
        check_messages(first_prompt(cfg.env, rows[0]), "env.verifiers: the first task's prompt")
    except VerifiersError as e:
        raise ConfigError([str(e)]) from None
    return rows


def check_target_modules(cfg: Config) -> None:
    """Unknown lora.target_modules fail here, on a weightless (meta) copy of the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from train_loops.lora import check_target_modules as check

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path))
    check(model, cfg.lora.target_modules)


def make_run_dir(cfg: Config, resume: Resume | None) -> tuple[Config, Path]:
    """RUN_DIR (run.out_dir/run.name) with the run's config.yaml; returns the config as written there and
    RUN_DIR. A fresh run never writes into an earlier run's directory: it takes the next free `NAME-k` and
    says so; a resumed run continues its own. Paths become absolute first: actors and replicas run in other
    working directories."""
    cfg = cfg.replace(model={"path": str(Path(cfg.model.path).resolve())},
                      run={"out_dir": str(Path(cfg.run.out_dir).resolve())})
    if cfg.reward.judge.model:
        cfg = cfg.replace(reward={"judge": cfg.reward.judge.replace(model=str(Path(cfg.reward.judge.model).resolve()))})
    if resume is None:
        wanted, cfg = cfg.run_dir, free_run_name(cfg)
        if cfg.run_dir != wanted:
            logger.warning("run dir %s exists: this run writes to %s", wanted, cfg.run_dir)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=resume is not None)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return cfg, run_dir


def free_run_name(cfg: Config) -> Config:
    """`cfg`, or a copy named NAME-k (the next free k) when RUN_DIR exists. A caller that reads the run's files
    after `driver.run` picks the name first: the driver then keeps it."""
    base, attempt = cfg.run.name, 1
    while cfg.run_dir.exists():
        attempt += 1
        cfg = cfg.replace(run={"name": f"{base}-{attempt}"})
    return cfg


def check_fits(cfg: Config) -> None:
    """A run the cluster cannot place would wait forever for resources: refuse it with the numbers."""
    import ray

    from common.placement import fit_problems

    problems = fit_problems(cfg, ray.cluster_resources())
    if problems:
        raise ConfigError(problems)
