"""The one error type for checkpoints that cannot be loaded, and the checked read of their JSON
files."""

import json
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or of an unsupported kind; the message names it."""


def read_json_object(f: Path, needed_by: str) -> dict:
    """The JSON object in file `f`; a CheckpointError naming it when it is missing (`needed_by`
    says what needs it), not JSON, or not an object."""
    if not f.is_file():
        raise CheckpointError(f"{f}: not found ({needed_by} needs {f.name})")
    try:
        obj = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{f}: not a JSON object")
    return obj
