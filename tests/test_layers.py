"""Dependencies point one way: the core packages never import the integrations and applications built on
them, not even inside a function body (a hidden import that dodges a cycle). Integrations plug into the core
through registries they fill (turnrl/compat registers verl's adapters and verifiers' sources). A package's
`cli.py` is the command layer (its `turnrl ...` subcommands), above everything, wherever it lives."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "turnrl"
CORE = ("config", "ledger", "models", "data", "chat", "engines", "env", "algo", "llm", "rewards", "rollout",
        "exact", "observe")
ABOVE = ("compat", "gateway", "train", "distributed", "bench", "cli", "collect")


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_the_core_never_imports_what_is_built_on_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if top not in CORE or path.name == "cli.py":
            continue
        for name in imports(path):
            parts = name.split(".")
            if parts[0] == "turnrl" and len(parts) > 1 and parts[1] in ABOVE:
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not wrong, "\n".join(wrong)
