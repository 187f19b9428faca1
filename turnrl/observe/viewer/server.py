"""`turnrl view RUN_DIR`: a small JSON API and one page, served with the standard library only.

Endpoints (all GET, JSON):
  /api/run                      run directory, model, bound per step
  /api/steps                    [{step, split, shown, saved, reward_mean}] (re-reads what was appended)
  /api/filters                  the values each filter can take
  /api/trajectories?step=&split=  summary rows (filtering happens in the page, the same code for an export)
  /api/trajectory/ID            one trajectory: conversation, rewards, tokens
  /api/group/ID                 the samples of ID's prompt at the same step, side by side
It binds 127.0.0.1 and refuses any other address unless `allow_remote` (`--allow-remote`) says so:
trajectories can hold prompts and data that are not for sharing, and the page has no authentication.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from turnrl.config.secrets import redact
from turnrl.observe.viewer.detail import TokenText, source_css, trajectory_detail
from turnrl.observe.viewer.index import RunIndex

PAGE = Path(__file__).with_name("page.html")


class Viewer:
    """The viewer's answers, independent of HTTP (the export calls the same methods)."""

    def __init__(self, run_dir: Path, per_step: int = 32):
        self.run_dir = Path(run_dir)
        self.index = RunIndex(self.run_dir, per_step)
        self.text = TokenText(self.run_dir)

    def run(self) -> dict[str, Any]:
        return {"name": self.run_dir.resolve().name, "path": str(self.run_dir.resolve()), "model": self.text.model,
                "per_step": self.index.per_step, "token_text": self.text.tokenizer is not None}

    def steps(self) -> list[dict[str, Any]]:
        self.index.refresh()
        return self.index.steps()

    def detail(self, tid: int) -> dict[str, Any]:
        traj, row = self.index.load(tid)
        return trajectory_detail(traj, row, self.text)

    def group(self, tid: int) -> dict[str, Any]:
        members = self.index.group(tid)
        return {"members": members, "details": [self.detail(m) for m in members]}


def page(data: dict[str, Any] | None = None) -> str:
    """The page, with the token colours filled in and, for an export, all of its data embedded."""
    # "<" only occurs inside JSON strings, where \u003c means the same: nothing can close the script tag
    embedded = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c") if data is not None else ""
    return PAGE.read_text(encoding="utf-8").replace("/*SOURCE_CSS*/", source_css()).replace("/*DATA*/", embedded)


def host_name(header: str) -> str:
    """The host of a Host header: `[::1]:8080` -> `::1`, `localhost:80` -> `localhost`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def make_handler(viewer: Viewer, check_host: bool = True) -> type[BaseHTTPRequestHandler]:
    html = page().encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if check_host and not is_loopback(host_name(self.headers.get("Host", ""))):
                # DNS rebinding: a page from another site, its name re-pointed at 127.0.0.1, would read ours
                return self._json(403, {"error": "Host must be a loopback name (localhost, 127.0.0.1, [::1]); "
                                                 "serve with --allow-remote to accept others"})
            url = urlparse(self.path)
            parts = [p for p in url.path.split("/") if p]
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                if not parts:
                    return self._send(200, html, "text/html; charset=utf-8")
                if parts[0] != "api" or len(parts) < 2:
                    return self._json(404, {"error": f"no such page: {url.path}"})
                return self._json(200, self._answer(parts[1:], query))
            except (KeyError, ValueError, IndexError) as exc:
                return self._json(404, {"error": str(exc)})

        def _answer(self, parts: list[str], query: dict[str, str]) -> Any:
            name = parts[0]
            if name == "run":
                return viewer.run()
            if name == "steps":
                return viewer.steps()
            if name == "filters":
                return viewer.index.filters()
            if name == "trajectories":
                step = int(query["step"]) if query.get("step") not in (None, "", "all") else None
                split = query.get("split") if query.get("split") not in (None, "", "all") else None
                return viewer.index.rows(step, split)
            if name == "trajectory" and len(parts) == 2:
                return viewer.detail(int(parts[1]))
            if name == "group" and len(parts) == 2:
                return viewer.group(int(parts[1]))
            raise KeyError(f"no such endpoint: /api/{'/'.join(parts)}")

        def _json(self, status: int, value: Any) -> None:
            # redacted again: a file written by an older turnrl, or before a secret was set, may hold one
            self._send(status, redact(json.dumps(value)).encode(), "application/json")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: no line per request
            pass

    return Handler


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_server(viewer: Viewer, host: str = "127.0.0.1", port: int = 0,
                allow_remote: bool = False) -> ThreadingHTTPServer:
    if not is_loopback(host):
        if not allow_remote:
            raise ValueError(f"refusing to serve on {host}: only loopback addresses (127.0.0.1, ::1, localhost) "
                             "unless --allow-remote; the page has no authentication and shows prompts, data and "
                             "model outputs. Prefer an SSH tunnel (ssh -L PORT:127.0.0.1:PORT host).")
        print(f"[turnrl] view: WARNING: serving on {host}, reachable from other machines; the trajectories "
              "(prompts, data, model outputs) are readable by anyone who can reach this port", file=sys.stderr)
    server_class = type("ViewerServer", (ThreadingHTTPServer,), {
        "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET, "daemon_threads": True})
    return server_class((host, port), make_handler(viewer, check_host=not allow_remote))


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 0, per_step: int = 32,
          allow_remote: bool = False) -> None:
    viewer = Viewer(run_dir, per_step)
    server = make_server(viewer, host, port, allow_remote)
    shown = f"[{host}]" if ":" in host else host
    print(f"turnrl view: http://{shown}:{server.server_address[1]}/  ({len(viewer.index.entries)} trajectories "
          f"from {viewer.index.path}; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
