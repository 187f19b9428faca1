"""A reward that varies on any output (even a random model's), so tiny runs have a learning signal."""


def length_parity(traj):
    text = ""
    for m in traj.messages:
        if m["role"] == "assistant":
            text = m["content"]
    return (len(text) % 5) / 4.0


class SlowUser:
    """A simulated user that answers once after `delay` seconds (async: the event loop runs on meanwhile), then
    ends the conversation: rows with a long delay are the stragglers of their batch."""

    def start(self, delay: float = 0.0, **_):
        self.delay, self.turns = float(delay), 0

    async def respond(self, messages):
        import asyncio

        from turnrl.env.interactions import Reply
        self.turns += 1
        if self.turns == 1:
            await asyncio.sleep(self.delay)
        return Reply("Go on.", done=self.turns >= 2)

    def finish(self):
        return 0.0
