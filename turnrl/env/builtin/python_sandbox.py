"""The built-in `python` tool: runs model-written code in an isolated sandbox worker (`turnrl.env.sandbox`).

The model sends `{"code": "..."}` and sees what the code printed (stdout and stderr together, cut at
`max_output_bytes`), followed by a note when it did not end normally: `[exit status 1]`, `[killed by
SIGXCPU]`, `[timed out after 5s; it and everything it started were killed]`. Those are the code's own
failures: they are ordinary tool output, stay in the loss and teach the policy. A sandbox that cannot do its
job (a worker that died or stopped answering) raises, so the tool layer records an environment error and
masks the trajectory. Each call runs in a fresh process and an empty directory: nothing persists between
calls. Every keyword of `SandboxSettings` is a key of the tool's `config:`; isolation is required unless
`allow_unisolated: true`.

    rollout:
      tools:
        - class_name: python
          config: {timeout_s: 5, memory_mb: 512, workers: 4}
"""

from __future__ import annotations

from typing import Any

from turnrl.env.sandbox import RunResult, SandboxSettings, pool_for
from turnrl.env.tools import ToolOutput


def describe(result: RunResult, settings: SandboxSettings) -> str:
    """The text the model sees for one run."""
    text = result.output
    if result.truncated:
        text += f"\n...[output cut at {settings.max_output_bytes} bytes]"
    if result.timed_out:
        note = f"[timed out after {settings.timeout_s:g}s; it and everything it started were killed]"
    elif result.signal:
        note = f"[killed by {result.signal}" + (": CPU time limit]" if result.signal == "SIGXCPU" else "]")
    elif result.exit:
        note = f"[exit status {result.exit}]"
    else:
        note = ""
    if note:
        text = f"{text}\n{note}" if text.strip() else note
    return text if text.strip() else "(no output)"


class PythonSandbox:
    name = "python"
    schema = {"type": "function", "function": {
        "name": "python",
        "description": "Run a Python 3 program and return what it prints. Each call starts from scratch in an "
                       "empty directory, without network access; only the standard library is available.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "the program; print what you want to see"}},
            "required": ["code"]}}}

    def __init__(self, **config: Any):
        if "import_paths" in config:
            config["import_paths"] = tuple(config["import_paths"] or ())
        self.settings = SandboxSettings(**config)   # TypeError/ValueError name the bad key
        self.pool = pool_for(self.settings)          # SandboxUnavailable when it cannot be isolated

    def execute(self, args: dict[str, Any]) -> ToolOutput:
        result = self.pool.run(str(args["code"]))
        metrics = {"exit": -1 if result.exit is None else result.exit, "timed_out": int(result.timed_out),
                   "truncated": int(result.truncated), "seconds": round(result.seconds, 3)}
        return ToolOutput(describe(result, self.settings), metrics=metrics)
