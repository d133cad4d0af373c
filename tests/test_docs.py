"""The documentation's commands, links and cited results are checked against the repository.

What is checked, and why this way:

- Every ``bash``/``sh`` block of README.md, docs/ and benchmarks/README.md is split into simple
  commands (``shlex``, on ``&&``, ``;``, ``|``, ``&``). A ``kvtier ...`` command (also as ``.venv/bin/kvtier``
  or ``python -m kvtier``) is parsed by the real argparse parser (``kvtier.cli.build_parser``), so
  a renamed subcommand, a removed flag or a bad choice fails here. Most blocks need a server, a
  GPU, a model or a network, so running them all is not robust; the commands that need none of
  these (``kvtier info`` and ``kvtier plan`` without ``--probe`` or ``--config``) are also run
  in-process and must exit 0, which checks their values too. A ``make X`` command must name a
  Makefile target.
- Every ``benchmarks/<script>.py`` and ``benchmarks/results/...`` path that any doc cites
  (README.md, docs/, benchmarks/README.md) must exist (a ``*`` or ``{a,b}`` in it must match at
  least one file), and so must every results file a doc names bare in inline code
  (``ttft_h200.txt``, ``serve_cpu.*``).
- Every relative markdown link in those files must resolve to a file of the repository, and a
  ``#anchor`` into a markdown page must name one of its headings (GitHub's or mkdocs' slug).

The docs site build (``mkdocs build --strict``, ``make docs-check``) checks the site's own links;
this test runs without mkdocs. No network, no GPU, a few seconds.

The vLLM connector and SGLang backend configs in the docs are parsed by the plug-ins' own option
parsers (no vLLM or SGLang needed), and a connector's host tier must fit its pinned budget.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from kvtier import cli

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ALL_DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
            *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_LINK = re.compile(r"(?<!!)\[(?:[^\]]+)\]\(([^)\s]+)\)")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_RESULTS_PATH = re.compile(r"benchmarks/results/[\w.{},*/-]+")
_BARE_RESULT = re.compile(r"^[a-z0-9]+(?:_[a-z0-9]+)+\.(?:txt|json|png|md|\*)$")
_SEPARATORS = {"&&", ";", "|", "||", "&"}
_RUNNABLE = {"info", "plan"}


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _without_fences(text: str) -> str:
    return _FENCE.sub("", text)


def _shell_blocks() -> list[tuple[str, str]]:
    """(where, block text) for every bash/sh block of the docs."""
    blocks = []
    for path in ALL_DOCS:
        for match in _FENCE.finditer(path.read_text(encoding="utf-8")):
            if match.group(1) in ("bash", "sh"):
                blocks.append((_rel(path), match.group(2)))
    return blocks


def _simple_commands(block: str) -> list[list[str]]:
    """The block's simple commands as argument lists, comments and env assignments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{raw}" if pending else raw
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quoted string goes on over the next line
            continue
        lines.append(pending)
        pending = ""
    assert not pending, f"unclosed quote in:\n{block}"
    commands: list[list[str]] = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token in _SEPARATORS:
                commands.append(current)
                current = []
            elif current or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token):
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def _kvtier_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``kvtier`` when ``argv`` runs the kvtier CLI, else None."""
    if Path(argv[0]).name == "kvtier":
        return argv[1:]
    if Path(argv[0]).name.startswith("python") and argv[1:3] == ["-m", "kvtier"]:
        return argv[3:]
    return None


def _kvtier_commands() -> list[tuple[str, list[str]]]:
    found = []
    for where, block in _shell_blocks():
        for argv in _simple_commands(block):
            args = _kvtier_args(argv)
            if args is not None:
                found.append((where, args))
    return found


def test_the_readme_sets_up_with_the_two_make_commands_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = [argv for _, block in _shell_blocks() for argv in _simple_commands(block)]
    assert ["make", "run"] in commands and ["make", "test"] in commands
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250


def test_the_docs_show_kvtier_commands_of_every_kind() -> None:
    used = {args[0] for _, args in _kvtier_commands() if args}
    assert {"serve", "info", "plan", "bench", "store"} <= used


@pytest.mark.parametrize(("where", "args"), _kvtier_commands(),
                         ids=lambda value: " ".join(value) if isinstance(value, list) else value)
def test_every_kvtier_command_in_the_docs_parses(where: str, args: list[str]) -> None:
    parser = cli.build_parser()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            parser.parse_args(args)
    except SystemExit as exc:
        assert exc.code == 0, f"{where}: `kvtier {' '.join(args)}` is refused:\n{out.getvalue()}"
    runnable = (args and args[0] in _RUNNABLE and "--probe" not in args and "--config" not in args
                and "--help" not in args)
    if runnable:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli.main(args)
        assert code == 0, f"{where}: `kvtier {' '.join(args)}` exits {code}:\n{out.getvalue()}"


def test_every_make_command_in_the_docs_names_a_makefile_target() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    for where, block in _shell_blocks():
        for argv in _simple_commands(block):
            if argv[0] == "make":
                named = [a for a in argv[1:] if "=" not in a]
                assert set(named) <= targets, f"{where}: `{' '.join(argv)}` names no target"


def _expand(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [p for alt in match.group(1).split(",")
            for p in _expand(pattern[:match.start()] + alt + pattern[match.end():])]


def _exists(rel: str) -> bool:
    rel = rel.rstrip(".,;:)")
    if not Path(rel).suffix:  # an output prefix, such as bench_redis.py's --out
        rel += ".*"
    return all(any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists() for p in _expand(rel))


_SCRIPT_PATH = re.compile(r"benchmarks/(?:\w+/)*\w+\.py")   # a script, in its folder or not


def test_every_benchmark_script_the_docs_cite_exists() -> None:
    missing = sorted({f"{_rel(path)}: {script}" for path in ALL_DOCS
                      for script in _SCRIPT_PATH.findall(path.read_text(encoding="utf-8"))
                      if not (ROOT / script).exists()})
    assert missing == []


def test_every_results_file_the_docs_cite_exists() -> None:
    missing = []
    for path in ALL_DOCS:
        text = path.read_text(encoding="utf-8")
        for cited in _RESULTS_PATH.findall(text):
            if cited.rstrip(".,;:)") != "benchmarks/results" and not _exists(cited):
                missing.append(f"{_rel(path)}: {cited}")
        for code in _INLINE_CODE.findall(_without_fences(text)):
            if _BARE_RESULT.match(code) and not _exists(f"benchmarks/results/{code}"):
                missing.append(f"{_rel(path)}: {code}")
    assert missing == []


def _slugs(heading: str) -> set[str]:
    text = unicodedata.normalize("NFKD", heading).replace("`", "").strip().lower()
    github = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-")
    return {github, mkdocs}


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*$", _without_fences(page.read_text(encoding="utf-8")),
                          re.MULTILINE)
    return {slug for heading in headings for slug in _slugs(heading)}


def _broken_links() -> list[str]:
    broken = []
    for path in ALL_DOCS:
        for target in _LINK.findall(_without_fences(path.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{_rel(path)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(path)}: {target} (no heading #{anchor})")
    return broken


def test_every_relative_link_in_the_docs_resolves() -> None:
    assert _broken_links() == []


def _plugin_configs(flag: str) -> list[tuple[str, dict[str, object]]]:
    """(where, JSON) of every ``--FLAG '...'`` in the docs' shell blocks."""
    found = []
    for where, block in _shell_blocks():
        for match in re.finditer(rf"--{flag} '(.*?)'", block, re.DOTALL):
            found.append((where, json.loads(match.group(1))))
    return found


def test_every_vllm_connector_config_in_the_docs_is_accepted_and_fits_its_pinned_budget() -> None:
    from kvtier.integrations.vllm.options import parse_connector_config

    configs = [(w, c) for w, c in _plugin_configs("kv-transfer-config")
               if c.get("kv_connector") == "KvtierConnector"]
    assert configs
    for where, config in configs:
        extra = config["kv_connector_extra_config"]
        assert isinstance(extra, dict), where
        options = parse_connector_config(extra, block_size=16, env={})
        host = options.config.host
        assert host.pool_bytes <= host.pinned_budget_bytes, (
            f"{where}: a {host.pool_bytes}-byte host tier does not fit the pinned budget "
            f"({host.pinned_budget_bytes}); the connector would refuse to start")


def test_every_sglang_backend_config_in_the_docs_is_accepted() -> None:
    from kvtier.integrations.sglang.options import parse_extra_config

    configs = _plugin_configs("hicache-storage-backend-extra-config")
    assert configs
    for _, config in configs:
        assert config["module_path"] == "kvtier.integrations.sglang"
        parse_extra_config(config, env={})
