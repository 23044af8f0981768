"""The user docs (README.md and docs/*.md) say what works: every code block in them runs here.

Each fenced block names its language. ```python blocks of one file run in order in one fresh
interpreter (a later block may use an earlier one's names), on the CPU, in a temporary folder.
```bash (or ```console, ```sh) blocks run one at a time with `bash -e` in the repository root,
with the venv's `offload-jobs` on PATH and a private state dir. A block that must not run here
(Docker, a GPU, a worker, a long job, a placeholder such as JOB) says so in its info string:
```bash no-run. Other languages (yaml, text, ...) are not run. A bare ``` fence fails the test,
so nobody forgets to decide. docs/cli.md and docs/yaml-reference.md are generated
(scripts/gen_docs.py) and skipped here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GENERATED = {"cli.md", "yaml-reference.md"}
SHELLS = {"bash", "sh", "console", "shell"}
README_MAX_LINES = 200
# Written on another branch (the exactly-once guarantees); a link to it counts once the file is here.
PENDING = {"docs/guarantees.md"}
FENCE = re.compile(r"^(```+|~~~+)(.*)$")


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    tags: list[str]  # the info string's words after the language: no-run, test-command
    code: str

    @property
    def runs(self) -> bool:
        return "no-run" not in self.tags

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def user_docs() -> list[Path]:
    return [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in GENERATED)]


def blocks(doc: Path) -> list[Block]:
    out: list[Block] = []
    lines = doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        lang = info[0].lower() if info else ""
        out.append(Block(doc, start, lang, info[1:], "\n".join(body) + "\n"))
    return out


ALL = [b for d in user_docs() for b in blocks(d)]
SHELL_BLOCKS = [b for b in ALL if b.lang in SHELLS and b.runs]
PY_DOCS = sorted({b.doc for b in ALL if b.lang == "python" and b.runs})


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OFFLOAD_JOBS_HOME"] = str(tmp_path / "home")  # never the user's worker or token
    for k in ("OFFLOAD_JOBS_URL", "OFFLOAD_JOBS_TOKEN", "OFFLOAD_JOBS_DB"):
        env.pop(k, None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the snippets say they run on the CPU
    return env


def test_every_block_names_its_language() -> None:
    bare = [b.where for b in ALL if not b.lang]
    assert not bare, f"fenced blocks without a language (say python, bash, bash no-run, yaml, text): {bare}"


def test_readme_is_short() -> None:
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move details to docs/"


def test_relative_links_resolve() -> None:
    broken = []
    for doc in user_docs():
        text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists() and str(path.relative_to(REPO)) not in PENDING:
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not broken, f"links to files that do not exist: {broken}"


def test_ci_runs_the_readme_test_command() -> None:
    # .ci/run ends with the README's test command, so what a user runs is what CI runs.
    cmds = [b.code.strip() for b in blocks(REPO / "README.md") if "test-command" in b.tags]
    assert len(cmds) == 1, "README.md needs one ```bash no-run test-command block"
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.lstrip().startswith("#")]
    assert ci[-1] == cmds[0], f".ci/run ends with {ci[-1]!r}, the README says {cmds[0]!r}"


def test_docs_have_runnable_blocks() -> None:
    # A guard on the extraction itself: if the parser stopped finding blocks, every test below
    # would pass on nothing.
    assert len(PY_DOCS) >= 2 and len(SHELL_BLOCKS) >= 2, (PY_DOCS, [b.where for b in SHELL_BLOCKS])


@pytest.mark.parametrize("doc", PY_DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_python_blocks_run(doc: Path, tmp_path: Path) -> None:
    runner = tmp_path / "run_blocks.py"
    chunks = [(b.where, b.code) for b in blocks(doc) if b.lang == "python" and b.runs]
    # Each block is compiled under its doc:line name, so a traceback points into the doc.
    runner.write_text(
        "import torch\ntorch.manual_seed(0)\nns = {'__name__': '__main__'}\n"
        f"for where, code in {chunks!r}:\n"
        "    exec(compile(code, where, 'exec'), ns)\n")
    r = subprocess.run([sys.executable, str(runner)], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"a python block of {doc.name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where)
def test_shell_blocks_run(block: Block, tmp_path: Path) -> None:
    code = block.code
    if block.lang == "console":  # only the `$ ` lines are commands
        code = "\n".join(ln[2:] for ln in code.splitlines() if ln.startswith("$ ")) + "\n"
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=REPO, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{block.where} failed (exit {r.returncode}):\n{code}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
