"""Section train: the Ray Train workers, DeepSpeed, the trainer's dtype and kernels, its restart budget."""
from __future__ import annotations

from common.config.base import Section, broken, option
from common.config.choices import DType, LigerMode, MpsPriority, ZeroStage

# The Liger rule, stated once: train_loops/fused_kernels.py raises it when the trainer finds no GPU at run time.
LIGER_ON_NEEDS_GPU = ("train.liger_kernels: on needs train.use_gpu and a GPU (Liger's kernels are Triton, GPU "
                      "only); set train.use_gpu=true on a GPU machine, or train.liger_kernels=auto or off")


class TrainConfig(Section):
    section = "train"
    num_workers: int = option(2, "Ray Train workers (ranks).", ge=1)
    cpus_per_worker: float = option(
        0.5, "CPUs reserved per worker (fractions let training and serving share 2 cores).", gt=0)
    use_gpu: bool = option(False, "Train on GPUs (nccl, bf16 under dtype auto).")
    gpus_per_worker: float = option(1.0, "GPUs reserved per worker when use_gpu; a fraction (e.g. 0.5) shares one "
                                         "GPU with a rollout replica (see recipes/gpu-1x.yaml).")
    zero_stage: ZeroStage = option(
        2, "DeepSpeed ZeRO stage 0-2 (3 is refused on GPU for LoRA: see the validation message).")
    max_tokens_per_micro_batch: int | None = option(
        None, "Padded tokens (sequences x longest sequence) per micro-batch; a step's sequences are split by their "
              "real lengths, the loss stays exact for any split. null = automatic from the model's shape and free "
              "memory (GPU) or 16384 (CPU).")
    max_grad_norm: float = option(1.0, "Gradient clipping (0 = off).", ge=0)
    total_steps: int = option(30, "Optimizer steps to run.", ge=1)
    max_minutes: float | None = option(
        None, "Training time budget: once the run's steps have taken this many minutes (counted over restarts and "
              "--resume), the step under way finishes, a checkpoint is saved and the run ends as a finished one "
              "(final eval, adapter, summary) short of train.total_steps; the lr schedule stays the one over "
              "train.total_steps. null: run train.total_steps.", gt=0)
    seed: int = option(0, "Seed of LoRA init, sampling and shuffles.")
    gradient_checkpointing: bool = option(False, "Recompute activations in backward (GPU, long sequences).")
    logprob_chunk: int = option(
        4096, "Tokens per chunk when computing token logprobs (bounds the log-softmax memory).", ge=1)
    liger_kernels: LigerMode = option(
        "auto", "Liger's fused RMSNorm / RoPE / SwiGLU kernels in the trainer (GPU; train_loops/fused_kernels.py): "
                "auto = when liger_kernel is installed and training runs on GPU.")
    fused_lora: bool = option(True, "LoRA linears add their update inside the base layer's GEMM, scaling the rank-r "
                                    "activation (train_loops/lora_linear.py): same math, less memory traffic; false = "
                                    "PEFT's own layer.")
    dtype: DType = option(
        "auto", "The trainer's weights and compute dtype; auto = model.dtype's. float32 under a bfloat16 "
                "model.dtype: the engines sample in bf16 and the trainer scores and learns in fp32, so the "
                "trainer/engine log ratio is the engine's rounding alone (Gemma 3 270M on one H200: 0.019, "
                "against 0.026 with both in bf16; BENCHMARKS section 9), for twice the trainer's weight memory "
                "and fp32 matmuls.")
    max_restarts: int = option(
        3, "Train worker-group restarts in a row (each restores the newest checkpoint) with no step logged between "
           "them before the run fails with one line (a crash that comes back every time). A logged step refills the "
           "budget, so a long run survives any number of faults spread over its life.", ge=0)
    profile_step: int | None = option(None, "profile this optimizer step with torch.profiler on rank 0 and write its "
                                            "top ops to RUN_DIR/profile.txt (None: off)", ge=1)
    mps: bool = option(
        False, "Run under CUDA MPS (cluster/gpu_mps.py) where the machine supports it: a daemon started before Ray, so "
               "a trainer and a replica sharing one GPU run their kernels side by side instead of taking turns (the "
               "measured best on one H200: BENCHMARKS.md section 14). One line says whether it is on and, if not, why "
               "(no nvidia-cuda-mps-control, a daemon that serves no client, a Ray cluster joined or already up); "
               "off, the run goes on time-sliced.")
    mps_priority: MpsPriority = option(
        "normal", "Under CUDA MPS (one GPU shared by the trainer and a replica; cluster/gpu_mps.py), the train "
                  "workers' CUDA_MPS_CLIENT_PRIORITY. below_normal: when SMs free up, the GPU starts a replica's "
                  "decode kernels before more blocks of the trainer's GEMMs (on the 1.5B reference workload it did "
                  "not shorten the step: BENCHMARKS.md, 'The GPU decode bound'). No effect without MPS.")
    mps_sm_percent: int = option(
        100, "Under CUDA MPS, the train workers' CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: the share of the GPU's SMs "
             "their kernels may occupy at once (100 = all). Below 100 keeps SMs free for a replica on the same GPU.",
        ge=1, le=100)

    def problems(self) -> list[str]:
        return broken(
            (not self.use_gpu or 0 < self.gpus_per_worker <= 1,
             f"train.gpus_per_worker: must be in (0, 1] (one worker uses at most one GPU), got {self.gpus_per_worker}"),
            (not (self.use_gpu and self.zero_stage == 3),
             "train.zero_stage: 3 is refused on GPU for LoRA. ZeRO-3 shards the frozen base weights and all-gathers "
             "every layer again in each forward and backward of every micro-batch (and the KL reference pass), "
             "to save optimizer state for a trainable part of a few MB; use zero_stage 2 (or 0), which keeps the "
             "base replicated and only reduces LoRA gradients"),
            (self.liger_kernels != "on" or self.use_gpu, LIGER_ON_NEEDS_GPU),
        )
