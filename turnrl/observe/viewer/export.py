"""`turnrl view RUN_DIR --export out.html`: the viewer page as one file, every answer of the API embedded.

The page reads the embedded answers instead of calling the server, so the file opens anywhere, offline:
no scripts, styles or fonts are loaded from outside it. It holds the same bounded sample as the server
(`per_step` trajectories per step and split), tokens included, so keep that bound small for big runs.
"""

from __future__ import annotations

from pathlib import Path

from turnrl.observe.viewer.server import Viewer, page


def export_html(run_dir: Path, out: Path, per_step: int = 32) -> Path:
    viewer = Viewer(run_dir, per_step)
    ids = [e.row["id"] for e in viewer.index.entries]
    data = {
        "run": viewer.run(), "steps": viewer.steps(), "filters": viewer.index.filters(),
        "rows": viewer.index.rows(),
        "details": {str(i): viewer.detail(i) for i in ids},
        "groups": {str(i): viewer.index.group(i) for i in ids},
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(data), encoding="utf-8")
    return out
