"""A reward that varies on any output (even a random model's), so tiny runs have a learning signal."""


def length_parity(traj):
    text = ""
    for m in traj.messages:
        if m["role"] == "assistant":
            text = m["content"]
    return (len(text) % 5) / 4.0
