"""The README cannot drift from the code: every shell block is run by a named test or marked as needing hardware
this machine lacks, every `python -m app` command and flag it shows exists, every path it names exists, and its
Layout table names exactly the modules on disk.

Markers, on the line right above a block's opening fence:
  <!-- checked-by: tests/test_x.py::test_name[, tests/test_y.py::test_other] -->  the named tests run its commands
  <!-- gpu-only --> / <!-- cluster-only -->                                       needs GPUs / a multi-node cluster
  <!-- synopsis: ... -->                                                           usage lines, each checked against
                                                                                   its command's --help below
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SHELL_INFOS = {"", "bash", "sh", "shell", "console"}
APP_CMD = re.compile(r"python -m app ([a-z][a-z-]*)([^`\n#]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
PATH = re.compile(r"(?<![\w/.$-])((?:app|common|train_loops|serve_deployments|benchmarks|scripts|cluster|recipes|docs"
                  r"|tests)/[\w./-]*[\w/]|[A-Z]+\.md|Dockerfile(?:\.cpu)?)(?![\w/-])")
PACKAGES = ("app", "common", "train_loops", "serve_deployments", "benchmarks", "cluster")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    info: str
    marker: str | None
    body: list[str]


def parse_blocks(text: str) -> list[Block]:
    """Fenced blocks with the HTML comment on the line above each (None when there is none)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = re.match(r"^```\s*([\w-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        above = lines[i - 1].strip() if i else ""
        marker = above[4:-3].strip() if above.startswith("<!--") and above.endswith("-->") else None
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"README.md:{i + 1}: a fence that never closes"
        blocks.append(Block(i + 1, m.group(1), marker, lines[i + 1:end]))
        i = end + 1
    return blocks


def checked_by(marker: str) -> list[tuple[str, str]]:
    """`checked-by: tests/a.py::t1, tests/b.py::t2` -> [(path, test name), ...]."""
    refs = [r.strip() for r in marker.split(":", 1)[1].split(",")]
    return [tuple(r.split("::", 1)) if "::" in r else (r, "") for r in refs]


def commands(line: str) -> list[tuple[str, list[str]]]:
    """Each `python -m app SUB ...` on a line: (SUB, the flags that follow it)."""
    return [(m.group(1), FLAG.findall(m.group(2))) for m in APP_CMD.finditer(line)]


@functools.cache
def app_help(*args: str) -> str:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "app", *args, "--help"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, f"python -m app {' '.join(args)} --help failed:\n{p.stderr[-2000:]}"
    return p.stdout


def top_level_commands() -> list[str]:
    section = app_help().split("commands:", 1)[1]
    return re.findall(r"^  ([a-z][a-z-]*)\s", section, re.M)


@pytest.fixture(scope="module")
def text() -> str:
    return README.read_text()


def test_parser_reads_markers_and_finds_an_unmarked_block():
    blocks = parse_blocks("intro\n<!-- gpu-only -->\n```bash\npython -m app train\n```\n\n```\nls\n```\n")
    assert [(b.line, b.info, b.marker, b.body) for b in blocks] == [
        (3, "bash", "gpu-only", ["python -m app train"]), (7, "", None, ["ls"])]
    assert commands("x && .venv/bin/python -m app train --config a.yaml --set k=v  # --no") == [
        ("train", ["--config", "--set"])]
    assert checked_by("checked-by: tests/a.py::t1, tests/b.py::t2") == [("tests/a.py", "t1"), ("tests/b.py", "t2")]


def test_every_shell_block_is_checked_or_marked(text):
    unmarked = [b.line for b in parse_blocks(text) if b.info in SHELL_INFOS and b.marker is None]
    assert not unmarked, f"README.md lines {unmarked}: a shell block needs <!-- checked-by: tests/...::test -->, " \
                         "<!-- gpu-only -->, <!-- cluster-only --> or <!-- synopsis: ... --> on the line above it"
    for b in parse_blocks(text):
        if b.info in SHELL_INFOS:
            kind = b.marker.split(":", 1)[0].strip()
            assert kind in {"checked-by", "gpu-only", "cluster-only", "synopsis"}, (
                f"README.md:{b.line}: unknown marker {b.marker!r}")


def test_checked_blocks_name_tests_that_run_their_commands(text):
    blocks = [b for b in parse_blocks(text) if b.marker and b.marker.startswith("checked-by")]
    assert len(blocks) >= 4
    for b in blocks:
        sources = []
        for path, name in checked_by(b.marker):
            src = (REPO / path).read_text() if (REPO / path).is_file() else None
            assert src is not None, f"README.md:{b.line}: {path} does not exist"
            assert name and re.search(rf"^(async )?def {re.escape(name)}\(", src, re.M), (
                f"README.md:{b.line}: {path} has no test {name!r}")
            sources.append(src)
        src = "\n".join(sources)
        for line in b.body:
            cmd = line.split("#", 1)[0]
            for sub, flags in commands(cmd):
                for word in (sub, *flags):
                    assert f'"{word}' in src, f"README.md:{b.line}: {b.marker} never runs `{sub}` with {word}"
                for recipe in re.findall(r"recipes/[\w.-]+\.yaml", cmd):
                    assert recipe in src, f"README.md:{b.line}: {b.marker} never uses {recipe}"
            ray = re.match(r"\s*ray ((?:[a-z][a-z-]* ?)+)(.*)", cmd)
            if ray:  # Ray's own CLI: its subcommands and flags, as the test runs them
                head_flags = FLAG.findall(ray.group(2).split(" -- ", 1)[0])
                for word in (*ray.group(1).split(), *head_flags):
                    assert f'"{word}' in src, f"README.md:{b.line}: {b.marker} never runs `ray ... {word}`"


def test_synopsis_lists_every_command(text):
    synopsis = [b for b in parse_blocks(text) if b.marker and b.marker.startswith("synopsis")]
    assert len(synopsis) == 1, "one Commands block"
    shown = {sub for line in synopsis[0].body for sub, _ in commands(line)}
    assert all(commands(line) for line in synopsis[0].body), "a synopsis holds only `python -m app` lines"
    assert shown == set(top_level_commands()), (
        f"Commands block: missing {set(top_level_commands()) - shown}, unknown {shown - set(top_level_commands())}")


def test_every_command_and_flag_the_readme_shows_exists(text):
    known = set(top_level_commands())
    shown = [(sub, flags) for line in text.splitlines() for sub, flags in commands(line)]
    assert len({sub for sub, _ in shown}) >= 8
    for sub, flags in shown:
        assert sub in known, f"README names `python -m app {sub}`, which `python -m app --help` does not list"
        if sub == "bench":
            continue  # `bench NAME [args]`: the arguments are the benchmark's own
        help_text = app_help(sub)
        for flag in flags:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), (
                f"README shows `python -m app {sub} ... {flag}`, which `python -m app {sub} --help` does not list")


def test_flags_in_prose_exist(text):
    """A flag named outside a `python -m app` command (`train --wait`, `--set`) is one some command takes."""
    other_tools = r"\s*(ray|docker|kubectl|bash|\.venv/bin/python -m pytest|python scripts/\S+) "
    prose = "\n".join(APP_CMD.sub("", line) for line in text.splitlines() if not re.match(other_tools, line))
    every = "\n".join(app_help(sub) for sub in top_level_commands() if sub != "bench")
    for flag in set(FLAG.findall(prose)):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", every), f"README names {flag}: no command has it"


def test_script_lines_use_flags_the_script_has(text):
    """`python scripts/X.py --flag` lines (the offline bundle's build) against that script's --help."""
    lines = [line for line in text.splitlines() if line.startswith("python scripts/")]
    assert lines, "the README shows the bundle build"
    for line in lines:
        script = line.split()[1]
        help_text = subprocess.run([sys.executable, str(REPO / script), "--help"], capture_output=True, text=True,
                                   timeout=60, cwd=REPO).stdout
        for flag in FLAG.findall(line.split("#")[0]):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), f"{script} has no {flag}"


def test_every_path_the_readme_names_exists(text):
    named = set(PATH.findall(text))
    assert "recipes/tiny-cpu.yaml" in named and "docs/main-job-reward.png" in named
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"README names paths that do not exist: {missing}"
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not re.match(r"https?://", link):
            assert (REPO / link).exists(), f"README links to {link}, which does not exist"


def test_every_recipe_is_in_the_recipes_table(text):
    on_disk = {f"recipes/{p.name}" for p in (REPO / "recipes").glob("*.yaml")}
    in_table = set(re.findall(r"^\| `(recipes/[\w.-]+\.yaml)` \|", text, re.M))
    assert in_table == on_disk, f"recipes table: missing {on_disk - in_table}, gone {in_table - on_disk}"


def layout_rows(text: str) -> dict[str, set[str]]:
    """The Layout table: folder -> the files its rows name."""
    section = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for folder, files in re.findall(r"^\| `([\w/]+/)` \| ([^|]*) \|", section, re.M):
        rows.setdefault(folder.rstrip("/"), set()).update(re.findall(r"`([\w.-]+)`", files))
    return rows


def test_layout_names_every_module_on_disk(text):
    rows = layout_rows(text)
    packages = sorted({str(p.parent.relative_to(REPO)) for top in PACKAGES for p in (REPO / top).rglob("__init__.py")})
    assert "app" in packages and "common/config" in packages
    for pkg in packages:
        on_disk = {p.name for p in (REPO / pkg).iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"}
        assert pkg in rows, f"Layout: no row for the package {pkg}/"
        named = {f for f in rows[pkg] if f.endswith((".py", ".sh"))}
        assert named == on_disk, f"Layout {pkg}/: missing {sorted(on_disk - named)}, gone {sorted(named - on_disk)}"
    for folder, files in rows.items():
        missing = sorted(f for f in files if not (REPO / folder / f).exists())
        assert not missing, f"Layout {folder}/ names files that do not exist: {missing}"


def test_readme_is_a_usage_readme(text):
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    first = parse_blocks(text)[0]
    assert first.line <= 4 and [c.split("#")[0].strip() for c in first.body] == [
        "bash scripts/setup.sh && .venv/bin/python -m app train --config recipes/tiny-cpu.yaml",
        "bash scripts/setup.sh && .venv/bin/python -m pytest -q"]
    assert not re.search(r"\b(issue|goal|sitting)s? \d", text), "history belongs in BENCHMARKS.md"


@pytest.mark.parametrize("heading", ["### reasoning-gym tasks", "### Judge rewards"])
def test_task_examples_are_valid_configs(text, tmp_path, heading):
    """The README's reasoning-gym and judge examples, as written there, on top of the main job's recipe: each is a
    config the loader accepts, and says what the section says it does."""
    import yaml

    from common import config as C

    if heading == "### reasoning-gym tasks":
        pytest.importorskip("reasoning_gym")
    section = text.split(heading + "\n", 1)[1]
    block = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-cpu.yaml").read_text())
    merged = {k: {**recipe.get(k, {}), **block.get(k, {})} for k in {*recipe, *block}}
    if heading == "### Judge rewards":
        merged["reward"]["judge"] = block["reward"]["judge"]
    else:  # the recipe's own reward.fn left out: with reasoning-gym data the task's checker is the default
        merged["reward"] = block.get("reward", {})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(merged))
    cfg = C.load(str(tmp_path / "c.yaml"))
    if heading == "### reasoning-gym tasks":
        assert cfg.data.path == cfg.eval.path == "reasoning-gym:chain_sum"
        assert cfg.reward.fn == "app.reasoning_gym_tasks:score_answer_tag"  # the task's checker on <answer>
    else:
        assert "{completion}" in cfg.reward.judge.template and cfg.reward.judge.model is None
        assert cfg.reward.fn == "app.rewards:letter_reward" and cfg.reward.judge.weight == 0.5
