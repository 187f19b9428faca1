"""One running vLLM server as a rollout engine: token ids in, sampled token ids and their logprobs out, over HTTP.

Generation uses vLLM's token-in/token-out endpoint `POST /inference/v1/generate` (a server started with
`--enable-scale-out`): the prompt goes as `token_ids`, `sampling_params` are vLLM's own (seed, `logprobs: 0`,
`stop_token_ids`, `ignore_eos`, `detokenize: false`), and the answer holds the sampled `token_ids`, one logprob
per token (`logprobs.content[i].logprob`, the sampled token's, with `--logprobs-mode processed_logprobs`:
log softmax(logits / temperature)), the finish reason, and `weight_versions`, the weight version each span of
the output was sampled with. Nothing is detokenized or re-tokenized. As in the in-process engine, top-p/top-k
requests are refused (vLLM would report the truncated distribution's logprobs) and greedy rows carry
temperature-1 logprobs.

Weights go through vLLM's RL API (`vllm/entrypoints/rl/online`, on with `VLLM_SERVER_DEV_MODE=1`):
`/pause?mode=wait` (running requests finish, caches are cleared, new ones wait), `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update` with the new version, `/resume`. The
transfer engine is `turnrl_file` (`vllm_transfer`): the tensors travel as one safetensors file the caller
wrote. LoRA adapters go through vLLM's adapter loading (`/v1/load_lora_adapter`, a peft directory), and
requests name the newest adapter as their model.

Versions: each server's weight version is set to `<run tag>:<version>` at connect and at every update, and
every answer's `weight_versions` must name the current one. A server that answers with another version was
restarted (vLLM starts at "default") or updated by someone else: `ServerDown` is raised, as for a server that
cannot be reached or answers HTTP 500 while its `/health` fails (vLLM answers the requests in flight of a
server whose engine died with 500, measured here), and the caller (`turnrl.engines.vllm_servers`) re-syncs it before it serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterable

import torch

from turnrl.engines.base import Completion, EngineError, Sampling
from turnrl.engines.vllm_weights import write_adapter

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class ServerDown(EngineError):
    """The server cannot be reached, dropped the connection, or serves other weights than it should."""


class VLLMServer:
    """Client of one vLLM server (the `Engine` protocol plus the pieces a pool of servers needs)."""

    def __init__(self, url: str, run_tag: str | None = None, lora: bool = False, timeout_s: float = 600.0,
                 model_name: str = "turnrl-policy", transfer_dtype: torch.dtype | None = None,
                 transfer_dir: str | None = None, seed: int = 0, partial_rollout: bool = False):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine.urls: {url!r} is not an http(s) URL (e.g. http://10.0.0.5:8000)")
        self.url = url.rstrip("/").removesuffix("/v1")
        self.run_tag = run_tag or f"turnrl-{uuid.uuid4().hex[:8]}"
        self.lora_enabled = lora
        self.timeout_s = timeout_s
        self.model_name = model_name
        self.transfer_dtype = transfer_dtype
        self.transfer_dir = transfer_dir
        self.seed = seed
        self.partial_rollout = partial_rollout   # updates abort the requests in flight, which are resumed
        self.updating = 0                        # weight updates under way (their aborts are interruptions)
        self.version = 0
        self.in_flight = 0
        self.streamed = 0                        # tokens received so far on streamed (partial-rollout) requests
        self.adapter: str | None = None          # the LoRA adapter requests name, once one is loaded
        self._adapter_dirs: list[tuple[str, Path]] = []
        self._ids = itertools.count()
        self._client: Any = None
        self._client_loop: Any = None
        self.stats = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "weight_updates": 0,
                      "lora_updates": 0}

    # -- transport ----------------------------------------------------------------------------------------
    def _http(self) -> Any:
        import httpx
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:   # an httpx client belongs to one loop
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            self._client_loop = loop
        return self._client

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx
        try:
            response = await self._http().request(method, self.url + path, **kwargs)
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise ServerDown(f"vLLM server {self.url} unreachable ({type(exc).__name__}: {exc})") from exc
        if response.status_code > 500:
            raise ServerDown(f"vLLM server {self.url}: HTTP {response.status_code} on {path}")
        if response.status_code == 500 and path != "/health" and not await self._healthy():
            # a dying server answers what it had in flight with 500 ("EngineCore encountered an issue")
            raise ServerDown(f"vLLM server {self.url}: HTTP 500 on {path} and its engine is down "
                             f"({response.text[:200]})")
        if response.status_code >= 400:
            raise EngineError(f"vLLM server {self.url} refused {path}: HTTP {response.status_code} "
                              f"{response.text[:500]}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:  # some routes (adapter loading) answer in plain text
            return response.text

    async def _healthy(self) -> bool:
        """Whether the server's engine is alive (`/health` is 200; vLLM answers 503 once its engine died)."""
        import httpx
        try:
            response = await self._http().get(self.url + "/health", timeout=10.0)
        except (httpx.TransportError, httpx.TimeoutException):
            return False
        return response.status_code == 200

    # -- lifecycle ----------------------------------------------------------------------------------------
    async def connect(self) -> str:
        """Check the server is up and serves our model with the RL API; returns the weight version it had
        ("default": the weights it started with)."""
        try:
            await self._request("GET", "/health")
        except ServerDown as exc:
            raise EngineError(f"{exc}: start it (see README 'Rolling out on vLLM servers') or set "
                              f"engine.launch to let turnrl start servers") from exc
        models = await self._request("GET", "/v1/models")
        names = [m.get("id") for m in (models or {}).get("data", [])]
        if self.model_name not in names:
            raise EngineError(f"vLLM server {self.url} serves {names}, not {self.model_name!r}: start it with "
                              f"--served-model-name {self.model_name} (or set engine.served_model_name)")
        try:
            info = await self._request("GET", "/weight_info")
        except EngineError as exc:
            raise EngineError(f"vLLM server {self.url} has no RL API ({exc}): start it with "
                              f"VLLM_SERVER_DEV_MODE=1 (python -m turnrl.engines.vllm_launch does)") from exc
        return str((info or {}).get("weight_version"))

    async def reset_prefix_cache(self) -> None:
        """Drop the server's cached prefix blocks (vLLM's dev-mode route, on in servers turnrl launches)."""
        await self._request("POST", "/reset_prefix_cache")

    async def set_version(self, version: int) -> None:
        await self._request("POST", "/update_weight_version", json={"new_version": self.tag(version)})
        self.version = version

    def tag(self, version: int) -> str:
        return f"{self.run_tag}:{version}"

    async def close(self) -> None:
        if self._client is not None:
            try:
                await self._client.aclose()
            except RuntimeError:  # its loop is gone
                pass
            self._client = None
        for _, directory in self._adapter_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        self._adapter_dirs = []

    # -- generation ---------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        if not prompt_ids:
            raise EngineError("empty prompt")
        if sampling.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {sampling.max_tokens}")
        if sampling.top_p < 1.0 or sampling.top_k > 0:
            raise EngineError("a vLLM server reports logprobs of the top-p/top-k truncated distribution, not the "
                              "full one the trainer recomputes: set rollout.sampling.top_p=1 and top_k=0")
        n = next(self._ids)
        seed = sampling.seed if sampling.seed is not None else (self.seed * 1_000_003 + n) & 0x7FFFFFFF
        body = {"token_ids": list(prompt_ids), "model": self.adapter or self.model_name,
                "request_id": f"turnrl-{os.getpid()}-{uuid.uuid4().hex[:12]}",
                "sampling_params": {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                                    "seed": seed, "logprobs": 0, "stop_token_ids": list(sampling.stop_token_ids),
                                    "ignore_eos": True, "detokenize": False, "skip_special_tokens": False}}
        while self.updating:   # sent now, it would be answered by the new weights, under a version not yet ours
            await asyncio.sleep(0.01)
        version = self.version
        expected = self.tag(version)
        self.in_flight += 1
        try:
            if self.partial_rollout:   # streamed: an aborted request's tokens all come back (FINAL_ONLY loses them)
                choice = await self._streamed({**body, "stream": True})
            else:
                choice = (await self._request("POST", "/inference/v1/generate", json=body))["choices"][0]
        finally:
            self.in_flight -= 1
        reason = _FINISH.get(str(choice.get("finish_reason")))
        if reason == "abort" and self.partial_rollout and (self.updating or self.version != version):
            reason = "interrupted"     # our own update's /pause?mode=abort: the caller resumes it
        if reason is None:
            raise EngineError(f"vLLM server {self.url} finished the request with {choice.get('finish_reason')!r}")
        ids = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [step["logprob"] for step in content]
        if len(logprobs) != len(ids):
            raise EngineError(f"vLLM server {self.url} returned {len(ids)} tokens and {len(logprobs)} logprobs")
        spans = choice.get("weight_versions")
        versions = {span.get("version") if isinstance(span, dict) else span[0] for span in spans or []}
        if ids and spans is not None and versions != {expected}:
            raise ServerDown(f"vLLM server {self.url} sampled with weight version {sorted(map(str, versions))}, "
                             f"expected {expected!r}: it restarted or was updated elsewhere")
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(prompt_ids)
        self.stats["generated_tokens"] += len(ids)
        return Completion(ids, logprobs, reason, version)

    async def _streamed(self, body: dict[str, Any]) -> dict[str, Any]:
        """A streamed `/inference/v1/generate`, its chunks joined into one choice as the plain answer has it."""
        import httpx
        ids: list[int] = []
        content: list[Any] = []
        spans: list[Any] | None = None
        finish = None
        try:
            async with self._http().stream("POST", self.url + "/inference/v1/generate", json=body) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode(errors="replace")
                    if response.status_code > 500 or not await self._healthy():
                        raise ServerDown(f"vLLM server {self.url}: HTTP {response.status_code} on generate")
                    raise EngineError(f"vLLM server {self.url} refused /inference/v1/generate: HTTP "
                                      f"{response.status_code} {text[:500]}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise EngineError(f"vLLM server {self.url} failed the request: {chunk['error']}")
                    for choice in chunk.get("choices") or []:
                        ids += choice.get("token_ids") or []
                        self.streamed += len(choice.get("token_ids") or [])
                        content += (choice.get("logprobs") or {}).get("content") or []
                        if choice.get("weight_versions") is not None:
                            spans = (spans or []) + list(choice["weight_versions"])
                        finish = choice.get("finish_reason") or finish
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise ServerDown(f"vLLM server {self.url} unreachable ({type(exc).__name__}: {exc})") from exc
        return {"token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish, "weight_versions": spans}

    # -- weights ------------------------------------------------------------------------------------------
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Full (or partial, LoRA-merged) weights: written to one file, then loaded through vLLM's RL API."""
        from turnrl.engines.vllm_transfer import write_update
        path, names, _ = await asyncio.to_thread(write_update, named_tensors, self.transfer_dtype, self.transfer_dir)
        try:
            await self.load_file(path, names, version)
        finally:
            path.unlink(missing_ok=True)

    async def load_file(self, path: Path, names: list[str], version: int) -> None:
        """Load the tensors of a safetensors file the server can read, and take `version`."""
        async with self._paused():
            await self._request("POST", "/init_weight_transfer_engine", json={"init_info": {}})
            await self._request("POST", "/start_weight_update")
            await self._request("POST", "/update_weights", json={"update_info": {"path": str(path), "names": names}})
            await self._request("POST", "/finish_weight_update", json={"weight_version": self.tag(version)})
            self.version = version
        self.stats["weight_updates"] += 1

    @contextlib.asynccontextmanager
    async def _paused(self) -> AsyncIterator[None]:
        """Generation paused around a weight change: running requests finish first (`wait`), or with partial
        rollouts are aborted at once and come back with their tokens (`abort`), to be resumed."""
        self.updating += 1
        try:
            await self._request("POST", "/pause", params={"mode": "abort" if self.partial_rollout else "wait"})
            try:
                yield
            finally:
                await self._request("POST", "/resume")
        finally:
            self.updating -= 1

    async def update_lora(self, adapter_tensors: dict[str, torch.Tensor], peft_config: dict[str, Any],
                          version: int) -> None:
        """Serve this peft adapter from now on (vLLM's `/v1/load_lora_adapter`)."""
        directory = await asyncio.to_thread(write_adapter, adapter_tensors, peft_config)
        try:
            await self.load_adapter(directory, version)
        finally:
            self._adapter_dirs.append((f"{self.run_tag}-v{version}", directory))
        # the previous adapter may still serve requests in flight; older ones go
        for name, old in self._adapter_dirs[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        self._adapter_dirs = self._adapter_dirs[-2:]

    async def load_adapter(self, directory: Path, version: int) -> None:
        if not self.lora_enabled:
            raise EngineError("this vLLM server engine has no LoRA slots: set engine.max_lora_rank to at least "
                              "model.lora.rank (servers started with --enable-lora --max-lora-rank R)")
        name = f"{self.run_tag}-v{version}"
        async with self._paused() if self.partial_rollout else contextlib.nullcontext():
            try:
                await self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name,
                                                                          "lora_path": str(directory)})
            except EngineError as exc:
                if "already" not in str(exc):
                    raise
            previous, self.adapter = self.adapter, name
            await self.set_version(version)
        if previous is not None and previous != name:
            try:
                await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": previous})
            except EngineError:
                pass  # already gone (the server restarted): nothing to free
        self.stats["lora_updates"] += 1
