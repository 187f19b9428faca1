"""Secrets (API keys): given by reference in configs, read only where they are used, kept out of every output.

A secret field (`logging.wandb_api_key`) holds one of:
- `env:NAME`: the value of environment variable NAME, read when the key is used;
- `file:PATH`: the contents of the file at PATH, surrounding whitespace stripped (e.g. a mounted secret);
- the key itself: accepted, but then it sits in a config file or a shell history, so prefer the two above.
Left unset, a client reads its own variable (wandb: WANDB_API_KEY).

Where it could leak, it is kept out: config dumps (`turnrl config show`, a run's config.yaml, checkpoints'
trainer_state.json, the config sent to trackers) show a reference as written and a literal key as '***';
errors never quote a secret's value; and `redact` removes, from the trajectories written to disk (which the
viewer shows, and which the viewer redacts again when it serves them), the metrics and tables files, every
secret this process resolved, the value of every environment variable named like a secret (a word of its name
is KEY, TOKEN, SECRET, PASSWORD, PAT, CREDENTIALS, AUTH, ...: AWS_SECRET_ACCESS_KEY, AZURE_OPENAI_KEY, GH_PAT),
the password of every URL-valued variable (DATABASE_URL) and every `scheme://user:password@` in the text,
should a tool or an error message echo one.
Model-written code never sees them: the python sandbox starts with an empty environment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from turnrl.config.loader import REDACTED, SECRET_NAME, URL_CREDENTIALS, ConfigError, redact_urls

SECRET_ENV = SECRET_NAME
MIN_REDACTED = 8                 # shorter values (flags like "1") would redact ordinary text
_RESOLVED: set[str] = set()


def resolve_secret(value: str | None, key: str) -> str | None:
    """The secret a field refers to; ConfigError (naming the field, never the value) when it cannot be read."""
    if value is None or value == "":
        return None
    if value.startswith("env:"):
        name = value[4:]
        secret = os.environ.get(name)
        if not secret:
            raise ConfigError(f"'{key}' refers to environment variable {name}, which is not set.")
    elif value.startswith("file:"):
        path = Path(value[5:]).expanduser()
        try:
            secret = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"'{key}' refers to file {path}, which cannot be read ({exc.strerror}).") from None
        if not secret:
            raise ConfigError(f"'{key}' refers to file {path}, which is empty.")
    else:
        secret = value
    _RESOLVED.add(secret)
    return secret


def known_secrets() -> list[str]:
    """Every secret this process resolved, the values of secret-named environment variables, and the passwords
    inside URL-valued ones (DATABASE_URL=postgres://user:PASSWORD@host)."""
    values = set(_RESOLVED) | {v for k, v in os.environ.items() if SECRET_ENV.search(k)}
    values |= {m.group(2) for v in os.environ.values() if "://" in v for m in URL_CREDENTIALS.finditer(v)}
    return sorted((v for v in values if len(v) >= MIN_REDACTED), key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with every known secret (as is, and as escaped inside a JSON string) and every password inside a
    URL replaced by '***'."""
    if "://" in text:
        text = redact_urls(text)
    for secret in known_secrets():
        for form in {secret, json.dumps(secret, ensure_ascii=False)[1:-1]}:
            if form in text:
                text = text.replace(form, REDACTED)
    return text
