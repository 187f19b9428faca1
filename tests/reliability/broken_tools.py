"""Tools that fail on purpose, named by path in the training configs of the fault tests."""


class Broken:
    """Every call raises, as a tool whose backend is down does."""
    name = "broken"
    schema = {"type": "function", "function": {"name": "broken", "description": "Look something up.",
                                               "parameters": {"type": "object", "properties": {}}}}

    def execute(self, args):
        raise RuntimeError("backend down")
