"""Training side: GRPO loss, LoRA model, DeepSpeed set-up, adapter publish, checkpoints, the per-worker
loop and its Ray Train wrapper, and the offline adapter merge tool. Imports nothing from `app/`."""
