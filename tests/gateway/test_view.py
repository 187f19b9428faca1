"""Recorded sessions in `turnrl view`: parity, gateway counters and break reasons reach the viewer."""

import asyncio

from turnrl.gateway.requests import parse_chat
from turnrl.gateway.serve import recorder
from turnrl.observe.viewer.server import Viewer


def test_recorded_session_shows_parity_and_breaks(scripted_gateway, tmp_path):
    gateway, _ = scripted_gateway(["first", "second"])
    session = gateway.open_session("row-7")
    user = [{"role": "user", "content": "hi"}]
    asyncio.run(gateway.chat(parse_chat({"model": "smol", "messages": user}), session))
    rewritten = user + [{"role": "assistant", "content": "edited"}, {"role": "user", "content": "more"}]
    asyncio.run(gateway.chat(parse_chat({"model": "smol", "messages": rewritten}), session))
    recorder(tmp_path)(gateway.close_session(session.id))
    viewer = Viewer(tmp_path)
    row = viewer.steps()
    d = viewer.detail(0)
    assert d["parity"] == "split" and d["metrics"]["gateway/breaks"] == 1 and len(d["segments"]) == 2
    assert "differs from the reply" in d["metrics"]["breaks"][0] and row
