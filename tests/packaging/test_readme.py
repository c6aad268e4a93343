"""README's Layout tree against the repository (`git ls-files`): every path it names exists,
every package folder and every runtime module is named, each under its own folder."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_PATHS = re.compile(r"((?:[\w.-]+(?:/|\.\w+))(?: [\w.-]+(?:/|\.\w+))*)(?:\s{2,}|$)")


def tree_paths(readme: str) -> list[str]:
    """The paths of the code block under "## Layout": a line's leading names (`x/` folders,
    `x.py` files, separated by single spaces) sit in the folder of the last line indented two
    spaces less; the rest of the line (after two spaces) describes them."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    out, folders = [], {}  # depth -> folder path
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        m = _PATHS.match(line.strip())
        if m is None or line.strip()[0] == "(":
            continue  # a description's continuation line
        parent = folders.get(depth - 1, "") if depth else ""
        for name in m.group(1).split():
            out.append(parent + name)
            if name.endswith("/"):
                folders[depth] = parent + name
    return out


def tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


def test_the_reader_on_a_hand_made_tree():
    readme = ("## Layout\n\n```\na/          x\n  b.py c.py   y\n  d/        z\n    e.py\n"
              "                (a continuation)\nf/\n```\n")
    assert tree_paths(readme) == ["a/", "a/b.py", "a/c.py", "a/d/", "a/d/e.py", "f/"]


def test_readme_layout_matches_the_repository():
    named = tree_paths((ROOT / "README.md").read_text())
    files = tracked()
    dirs = {str(Path(f).parent) + "/" for f in files} | {
        "/".join(f.split("/")[:i]) + "/" for f in files for i in range(1, f.count("/") + 1)}
    missing = [p for p in named if p not in dirs and p not in files]
    assert missing == [], f"README names paths that are not in the repository: {missing}"
    packages = {str(Path(f).parent) + "/" for f in files
                if f.endswith("__init__.py") and not f.startswith("tests/")}
    top = {f.split("/")[0] + "/" for f in files if "/" in f and not f.startswith(".")}
    runtime = {f for f in files if f.startswith("runtime/") and f.endswith(".py")
               and not f.endswith("__init__.py")}
    unnamed = sorted((packages | top | runtime) - set(named))
    assert unnamed == [], f"README's Layout does not name: {unnamed}"
