"""The viewer in a real browser: headless Debian chromium, driven over the DevTools protocol.

`turnrl view RUN_DIR --port 0` runs in a subprocess; chromium starts with `--remote-debugging-port=0` and
writes the port it chose to DevToolsActivePort in its profile directory; the test talks CDP over a websocket
(websocket-client) to the page target: Runtime.evaluate to read and click, Input.dispatchMouseEvent to
hover, Page.captureScreenshot for the PNGs saved to test-artifacts/.
"""

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from turnrl.ledger import Source
from turnrl.observe.viewer.detail import MASK_COLOUR, SOURCE_COLOURS
from turnrl.observe.viewer.export import export_html

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

pytestmark = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                                reason=f"{CHROMIUM} not found: scripts/setup.sh installs Debian's chromium as root "
                                       "(apt-get install chromium)")
websocket = pytest.importorskip("websocket", reason="websocket-client is in the test extra: pip install -e '.[test]'")


def rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


class Page:
    """A minimal CDP client for one page target."""

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)
        self.events = []                          # CDP events received while waiting for replies

    def send(self, method: str, **params):
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def js(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 30.0):
        deadline, error = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                value = self.js(expression)
            except RuntimeError as exc:   # e.g. no document.body yet while the page loads
                value, error = None, exc
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"page never satisfied: {expression} (last error: {error})")

    def choose(self, select_id: str, value: str):
        """Set a <select> and fire its change event, as a user's pick does."""
        self.js(f"(() => {{ const s = document.getElementById({json.dumps(select_id)}); s.value = {json.dumps(value)};"
                " s.dispatchEvent(new Event('change')); })()")

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / name
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self):
        self.ws.close()


@pytest.fixture
def viewer_url(run_dir):
    main = "import sys; from turnrl.cli import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", main, "view", str(run_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert match, f"no URL printed: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        yield match.group(0)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def page(tmp_path):
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync",
                             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-port=0",
                             "--window-size=1400,1000", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            assert proc.poll() is None, "chromium exited at start"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30))
        p = Page(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
        yield p
        p.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


TOKENS_JS = """[...document.querySelectorAll('#detail .toks .tok')].map(e => {
  const s = getComputedStyle(e);
  return {seg: +e.dataset.seg, id: +e.dataset.id, source: +e.dataset.source, mask: +e.dataset.mask,
          logprob: e.dataset.logprob ?? null, trainer: e.dataset.trainerLogprob ?? null,
          bg: s.backgroundColor, line: s.borderBottomColor, width: s.borderBottomWidth, style: s.borderBottomStyle};
})"""


def test_filter_open_and_tokens_match_the_ledger(run_dir, ledger, viewer_url, page):
    # the trajectory to open: one with a tool call; the filter is its termination reason
    line = next(i for i, (t, _) in enumerate(ledger) if any(turn.tool_calls for turn in t.turns)
                and t.termination == "max_assistant_turns")
    traj, extra = ledger[line]
    reason = traj.termination
    expected_rows = sum(1 for t, _ in ledger if t.termination == reason)
    assert 0 < expected_rows < len(ledger)   # the filter has something to remove

    page.send("Page.enable")
    page.send("Page.navigate", url=viewer_url)
    page.wait("document.body.dataset.ready === '1'")
    page.choose("f-step", "all")
    assert page.js("document.querySelectorAll('#list .row').length") == len(ledger)
    page.screenshot("viewer-1-list.png")

    page.choose("f-termination", reason)
    shown = page.js("[...document.querySelectorAll('#list .row')].map(r => r.dataset.termination)")
    assert shown == [reason] * expected_rows

    rows = json.load(urllib.request.urlopen(viewer_url + "api/trajectories", timeout=30))
    tid = next(r["id"] for r in rows if r["line"] == line)
    page.js(f"document.querySelector('#list .row[data-id=\"{tid}\"]').click()")
    page.wait(f"document.getElementById('detail').dataset.id === '{tid}' && "
              "document.querySelectorAll('#detail .toks .tok').length > 0")
    assert page.js("document.querySelectorAll('#detail .call').length") == sum(len(t.tool_calls) for t in traj.turns)

    tokens = page.js(TOKENS_JS)
    expected = [(k, i) for k, seg in enumerate(traj.segments) for i in range(len(seg))]
    assert len(tokens) == len(expected)
    trainer = traj.metrics["trainer_logprobs"]
    for tok, (k, i) in zip(tokens, expected):
        seg = traj.segments[k]
        assert (tok["seg"], tok["id"], tok["source"], tok["mask"]) == (k, seg.token_ids[i], seg.sources[i],
                                                                      seg.loss_mask[i])
        assert tok["bg"] == rgb(SOURCE_COLOURS[Source(seg.sources[i])])
        assert tok["width"] == "2px" and tok["style"] == "solid"
        assert tok["line"] == (rgb(MASK_COLOUR) if seg.loss_mask[i] else "rgba(0, 0, 0, 0)")
        if seg.sources[i] == Source.POLICY:
            assert float(tok["logprob"]) == pytest.approx(seg.logprobs[i])
            assert float(tok["trainer"]) == pytest.approx(trainer[i])
        else:
            assert tok["logprob"] is None and tok["trainer"] is None
    assert {t["source"] for t in tokens} >= {Source.PROMPT, Source.POLICY, Source.TOOL, Source.TEMPLATE}
    assert any(t["mask"] for t in tokens)

    # hover a policy token: the tooltip shows its logprob and the trainer-engine mismatch
    box = page.js("(() => { const e = [...document.querySelectorAll('#detail .toks .tok')]"
                  ".find(e => e.dataset.mask === '1'); e.scrollIntoView({block: 'center'});"
                  " const r = e.getBoundingClientRect();"
                  " return {x: r.left + r.width / 2, y: r.top + r.height / 2, lp: e.dataset.logprob}; })()")
    page.send("Input.dispatchMouseEvent", type="mouseMoved", x=box["x"], y=box["y"])
    tip = page.wait("!document.getElementById('tip').hidden && document.getElementById('tip').textContent")
    assert f"engine logprob {float(box['lp']):.4f}" in tip
    assert f"mismatch (trainer − engine) {-0.0625:.4f}" in tip
    page.screenshot("viewer-2-tokens.png")

    page.js("window.scrollTo(0, 0); document.getElementById('main').scrollTop = 0; "
            "document.getElementById('open-group').click()")
    group = [i for i, (t, e) in enumerate(ledger) if t.group_id == traj.group_id and e == extra]
    page.wait(f"document.querySelectorAll('#group .col').length === {len(group)}")
    advantages = page.js("[...document.querySelectorAll('#group .col')].map(c => c.textContent)")
    for text, i in zip(advantages, group):
        advantage = ledger[i][0].metrics["advantage"]     # the page shows whole numbers without decimals
        assert f"advantage {int(advantage) if float(advantage).is_integer() else f'{advantage:.3f}'}" in text
    page.screenshot("viewer-3-group.png")


def test_the_export_opens_offline(run_dir, ledger, page, tmp_path):
    out = export_html(run_dir, tmp_path / "run.html")
    line = len(ledger) - 2
    page.send("Network.enable")
    page.send("Page.navigate", url=f"{out.as_uri()}#t={line}")
    page.wait(f"document.getElementById('detail') && document.getElementById('detail').dataset.id === '{line}'")
    tokens = page.js(TOKENS_JS)
    assert [t["id"] for t in tokens] == ledger[line][0].segment.token_ids
    assert page.js("document.getElementById('reload').hidden") is True
    page.screenshot("viewer-4-export.png")
    urls = [e["params"]["request"]["url"] for e in page.events if e["method"] == "Network.requestWillBeSent"]
    assert urls and all(u.startswith("file://") for u in urls), urls
