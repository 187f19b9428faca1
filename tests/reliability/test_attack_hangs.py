"""Nothing hangs forever (issue 17 item 3): a judge server that trickles one byte at a time is cut at
`timeout_s` for the whole request, and a tool stuck in a thread does not keep the process alive."""

import asyncio
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from turnrl.llm.client import OpenAITransport, Retryable


class Trickle(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(200):              # one byte every 0.2 s: each gap is far below timeout_s
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_a_trickling_judge_server_is_cut_at_timeout_s_for_the_whole_request():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    transport = OpenAITransport(f"http://127.0.0.1:{server.server_address[1]}/v1", "judge", timeout_s=1.5)

    async def ask():
        try:
            return await transport([{"role": "user", "content": "hi"}], "", 8, 0.0)
        finally:
            await transport.close()
    start = time.monotonic()
    try:
        with pytest.raises(Retryable, match="timed out after 1.5s"):
            asyncio.run(ask())
    finally:
        server.shutdown()
        server.server_close()
    assert time.monotonic() - start < 6


HANGING_TOOL = r'''
import asyncio, json, threading, time
from turnrl.env.tools import ToolSession
from turnrl.ledger import ToolCall

class Stuck:
    name = "stuck"
    schema = {"type": "function", "function": {"name": "stuck", "parameters": {"type": "object", "properties": {}}}}
    def execute(self, args):
        threading.Event().wait()          # blocked for good, as a tool in a dead socket read is

async def main():
    session = ToolSession({"stuck": Stuck()}, timeout_s=0.5)
    (result,) = await session.execute_all([ToolCall("stuck", {}, "", "c1")])
    print("RESULT", result.error, flush=True)

asyncio.run(main())
print("SUMMARY done", flush=True)
'''


def test_the_process_exits_after_a_tool_thread_hangs(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANGING_TOOL)
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit after its work: a hung tool thread keeps it alive")
    assert "RESULT tool 'stuck' timed out after 0.5s" in proc.stdout and "SUMMARY done" in proc.stdout
    assert proc.returncode == 0 and time.monotonic() - start < 30
