"""The trajectory viewer: `turnrl view RUN_DIR` serves it, `--export` writes it as one HTML file.

index.py reads the run's trajectories.jsonl (a bounded sample per step), detail.py turns one trajectory into
what the page shows, server.py answers the page's questions over HTTP, export.py embeds the answers in the
page, page.html is the page (inline CSS and JS, nothing loaded from elsewhere).
"""
