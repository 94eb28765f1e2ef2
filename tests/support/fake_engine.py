"""A deterministic in-process stand-in for vLLM's AsyncLLM and its OpenAI serving classes, for unit tests of
the replica (serve_deployments/replica.py) without an engine process: the real one needs minutes and a
whole CPU to start, and a unit test wants to hold requests in flight, fail one on purpose and see what was
aborted, which the real engine cannot be told to do.

What it implements is the engine surface vllm_engine.py lists: `generate` (an async generator yielding one
final output whose token ids and logprobs follow from the prompt and the LoRA id, so a test can tell which
adapter served a request), `add_lora` / `remove_lora`, aborting a request whose generator is cancelled,
`pause_generation` / `resume_generation`, `check_health`, `tokenizer.decode`, the block size and
max_model_len, `collective_rpc` / `reset_prefix_cache` (merge mode). `FakeServing` is the OpenAI serving
handlers' surface over it (`lora_requests`, `create_completion`, `create_chat_completion`).
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

VOCAB = 1000


def token_ids_for(prompt_ids: list[int], lora_id: int, n: int) -> list[int]:
    """The tokens the fake engine samples: a function of the prompt and the adapter only."""
    return [(sum(prompt_ids) + 7 * i + 31 * lora_id) % VOCAB for i in range(n)]


def logprob_for(token: int, i: int) -> float:
    return -((token % 13) + 1) / 10.0 - i / 100.0


class FakeTokenizer:
    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"t{t}" for t in token_ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]


class FakeEngine:
    """`gate`: when set to an asyncio.Event, every request waits for it before finishing (requests in flight);
    `fail_next`: that many upcoming requests raise inside the engine; `dead`: check_health raises."""

    def __init__(self, block_size: int = 16, max_model_len: int = 512):
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size))
        self.model_config = SimpleNamespace(max_model_len=max_model_len)
        self.tokenizer = FakeTokenizer()
        self.loras: dict[int, str] = {}  # LoRA int id -> the PEFT dir it was added from
        self.running: dict[str, object] = {}  # request id -> its LoRA request (None: base weights)
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None
        self.fail_next = 0
        self.dead = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.shut_down = False

    async def generate(self, prompt: dict, params, request_id: str, lora_request=None):
        if request_id in self.running:
            raise ValueError(f"request id {request_id} is already running")  # vLLM requires unique ids
        self.running[request_id] = lora_request
        try:
            await self._resumed.wait()
            if self.fail_next:
                self.fail_next -= 1
                raise RuntimeError(f"engine failed request {request_id}")
            if self.gate is not None:
                await self.gate.wait()
            prompt_ids = list(prompt["prompt_token_ids"])
            lora_id = lora_request.lora_int_id if lora_request is not None else 0
            if lora_id and lora_id not in self.loras:
                raise RuntimeError(f"LoRA {lora_id} was never added (or removed while in use)")
            tokens = token_ids_for(prompt_ids, lora_id, int(params.max_tokens))
            logprobs = None
            if params.logprobs is not None:
                logprobs = [{t: SimpleNamespace(logprob=logprob_for(t, i))} for i, t in enumerate(tokens)]
            out = SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reason="length",
                                  text=self.tokenizer.decode(tokens))
            self.finished.append(request_id)
            yield SimpleNamespace(request_id=request_id, outputs=[out], num_cached_tokens=0, finished=True)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)  # what vLLM does when the caller stops iterating: abort it
            raise
        finally:
            self.running.pop(request_id, None)

    async def add_lora(self, req) -> bool:
        if not Path(req.lora_path, "adapter_config.json").exists():
            raise RuntimeError(f"no PEFT dir at {req.lora_path}")
        self.loras[req.lora_int_id] = req.lora_path
        return True

    async def remove_lora(self, int_id: int) -> bool:
        return self.loras.pop(int_id, None) is not None

    async def collective_rpc(self, method: str, args=()):
        self.calls.append(method)
        return [{"lora_wrappers": 0}]

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    async def pause_generation(self, mode: str = "keep", clear_cache: bool = False) -> None:
        self._resumed.clear()

    async def resume_generation(self) -> None:
        self._resumed.set()

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("engine dead")

    def shutdown(self) -> None:
        self.shut_down = True


def fake_engine_factory(engine: dict, replica_id: str, prefix) -> FakeEngine:
    """replica.py's `engine_factory`: a FakeEngine with the engine kwargs' block size and max_model_len."""
    return FakeEngine(int(engine.get("block_size") or 16), int(engine.get("max_model_len") or 512))


class FakeResponse:
    def __init__(self, data: dict):
        self.data = data

    def model_dump(self, mode: str = "json", exclude_none: bool = True) -> dict:
        return dict(self.data)


class FakeServing:
    """vLLM's OpenAI serving handlers over a FakeEngine: the request's model name is looked up in
    `lora_requests` (the base model's names serve the base weights) and generated on the engine.
    `result`: when set, `result(request)` is returned instead (an ErrorResponse, an exception raised)."""

    BASE_NAMES = ("base",)

    def __init__(self, engine: FakeEngine, model: str = "", tool_parser: str | None = None):
        self.engine = engine
        self.lora_requests: dict = {}
        self.requests: list = []
        self.result = None

    async def _run(self, request, prompt_ids: list[int]):
        self.requests.append(request)
        if self.result is not None:
            return self.result(request)
        if request.model in self.BASE_NAMES:
            lora = None
        elif request.model in self.lora_requests:
            lora = self.lora_requests[request.model]
        else:
            raise LookupError(f"model {request.model} is not loaded")
        params = SimpleNamespace(max_tokens=request.max_tokens or 16, logprobs=None)
        final = None
        async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params,
                                              f"cmpl-{len(self.requests)}", lora_request=lora):
            final = out
        text = final.outputs[0].text
        if request.stream:
            return self._stream(text)
        return FakeResponse({"id": f"cmpl-{len(self.requests)}", "object": "text_completion", "model": request.model,
                             "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    async def _stream(self, text: str):
        import json

        for word in text.split(" "):
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': word}]})}\n\n"
        yield "data: [DONE]\n\n"

    async def create_completion(self, request):
        return await self._run(request, self.engine.tokenizer.encode(str(request.prompt)))

    async def create_chat_completion(self, request):
        text = " ".join(str(m.get("content", "")) for m in request.messages)
        return await self._run(request, self.engine.tokenizer.encode(text))
