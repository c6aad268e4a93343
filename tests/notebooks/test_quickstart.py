"""notebooks/quickstart.ipynb runs top to bottom headless on CPU (QUICK sizes, same code path)."""

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NB = ROOT / "notebooks" / "quickstart.ipynb"


def test_committed_notebook_is_generated_and_cleared():
    from jaxinfer.tools.make_notebook import build

    committed = nbformat.read(NB, as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in build().cells], \
        "notebooks/quickstart.ipynb is stale: run python -m jaxinfer.tools.make_notebook"
    assert all(not c.get("outputs") for c in committed.cells if c.cell_type == "code")


@pytest.mark.timeout(900)
def test_quickstart_executes(tmp_path):
    nb = nbformat.read(NB, as_version=4)
    env_before = os.environ.get("JAXINFER_QUICK")
    os.environ["JAXINFER_QUICK"] = "1"
    try:
        t0 = time.perf_counter()
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT)}}).execute()
        wall = time.perf_counter() - t0
    finally:
        if env_before is None:
            os.environ.pop("JAXINFER_QUICK")
        else:
            os.environ["JAXINFER_QUICK"] = env_before
    print(f"quickstart executed in {wall:.0f}s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) == 1, "the TTFT/ITL plot cell must produce one image"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "the capital of the country of France" in text  # the greedy generation ran


def test_the_extra_the_notebook_names_installs_what_it_imports():
    """Every third-party module the notebook imports comes with `pip install '.[notebook]'`:
    a core dependency or one of the `notebook` extra's."""
    import ast
    import importlib.metadata as md
    import re
    import sys
    import tomllib

    nb = nbformat.read(NB, as_version=4)
    assert "pip install -e '.[notebook]'" in nb.cells[0].source
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-")
               for d in project["dependencies"] + project["optional-dependencies"]["notebook"]}
    dists_of = md.packages_distributions()
    missing = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for top in {n.split(".")[0] for n in names}:
                if top in sys.stdlib_module_names or top == "jaxinfer":
                    continue
                dists = {d.lower().replace("_", "-") for d in dists_of.get(top, [top])}
                if not dists & allowed:
                    missing.add(top)
    assert "matplotlib" in allowed and not missing, missing
