"""What a verl user brings besides code: verl-format parquet rows (tools_kwargs, interaction_kwargs, a chat
prompt with worked examples) and the tool and interaction YAMLs naming verl_env.py's classes. Shared by the
`turnrl verl` tests (test_verl_cli.py, test_verl_keys.py)."""

CALL = '<tool_call>\n{"name": "counter", "arguments": {}}\n</tool_call>'
TOOLS_YAML = """tools:
  - class_name: verl_env.CounterTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: counter
        description: Add one (or `step`) to a running count and return the count.
        parameters:
          type: object
          properties:
            step: {type: integer, description: how much to add (default 1)}
          required: []
"""
INTERACTION_YAML = """interaction:
  - name: retry
    class_name: verl_env.RetryInteraction
    config:
      tries: 2
"""


def demo(k: int) -> list[dict]:
    """A worked example: k counter calls, then the count (small models call tools when shown how)."""
    msgs = [{"role": "user", "content": f"Call the counter tool {k} times, then tell me the count."}]
    for i in range(1, k + 1):
        msgs += [{"role": "assistant", "content": CALL}, {"role": "tool", "content": f"count={i} (call {i})"}]
    return msgs + [{"role": "assistant", "content": f"The count is {k}."}]


def verl_row(i: int, n: int, agent: str, tools: bool = True, interaction: bool = True) -> dict:
    """A verl row; a row without tools (interaction) carries an empty `tools_kwargs` (`interaction_kwargs`), as
    verl's preprocessing scripts write them: in a parquet file whose rows mix modes, pyarrow reads these back
    null-filled (`{counter: None}`, `{name: None, ground_truth: None}`)."""
    extra = {"index": i, "split": "train",
             "tools_kwargs": {"counter": {"create_kwargs": {"start": 0}}} if tools else {},
             "interaction_kwargs": {"name": "retry", "ground_truth": str(n)} if interaction else {}}
    return {"data_source": "counter", "agent_name": agent, "ability": "tool",
            "prompt": [{"role": "system", "content": "You are a helpful assistant."}, *demo(4), *demo(5),
                       {"role": "user", "content": f"Call the counter tool {n} times, then tell me the count."}],
            "reward_model": {"style": "rule", "ground_truth": str(n)}, "extra_info": extra}
