"""mkdocs hooks for kvtier's docs site (mkdocs.yml names this file under ``hooks``).

Owns two things, run by mkdocs on its main thread during ``mkdocs build`` / ``mkdocs serve``:

- the site's home page is the repository's README.md: it is added as ``index.md``, its links
  rewritten from the repository root to the docs folder (``docs/guide/x.md`` -> ``guide/x.md``,
  anything else -> ``../path``);
- a link that leaves the docs folder (a benchmark script, a results file, the Makefile) cannot be
  served by the site, so it is checked against the repository instead: a target that exists
  becomes inline code naming its path, a target that does not is logged as a warning, which
  ``mkdocs build --strict`` (run by ``make test``) turns into a failure.

Links inside the docs folder are left to mkdocs' own validation.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.kvtier")

#: Markdown inline links: [text](target) or [text](target#anchor).
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
_CODE = re.compile(r"(^```.*?^```)", re.DOTALL | re.MULTILINE)


def _root(config: Any) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _docs_rel(config: Any) -> str:
    return Path(config["docs_dir"]).resolve().relative_to(_root(config)).as_posix()


def _outside_code(text: str, fn: Any) -> str:
    """Apply ``fn`` to the parts of ``text`` outside fenced code blocks."""
    parts = _CODE.split(text)
    return "".join(part if i % 2 else fn(part) for i, part in enumerate(parts))


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target)) or target.startswith(("#", "/"))


def on_files(files: Files, config: Any) -> Files:
    readme = (_root(config) / "README.md").read_text(encoding="utf-8")
    prefix = _docs_rel(config) + "/"

    def relink(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if _is_external(target):
            return match.group(0)
        new = target[len(prefix):] if target.startswith(prefix) else "../" + target
        return f"[{text}]({new})"

    content = _outside_code(readme, lambda part: _LINK.sub(relink, part))
    files.append(File.generated(config, "index.md", content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    root = _root(config)
    docs = _docs_rel(config)
    page_dir = posixpath.dirname(posixpath.join(docs, page.file.src_uri))

    def check(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if _is_external(target):
            return match.group(0)
        path = target.split("#", 1)[0]
        resolved = posixpath.normpath(posixpath.join(page_dir, path))
        if resolved == docs or resolved.startswith(docs + "/"):
            return match.group(0)  # inside the docs: mkdocs validates it
        if not (root / resolved).exists():
            log.warning("%s links to %s, which is not in the repository", page.file.src_uri,
                        resolved)
            return match.group(0)
        if text.strip("`") in (target, resolved):
            return f"`{resolved}`"
        return f"{text} (`{resolved}`)"

    return _outside_code(markdown, lambda part: _LINK.sub(check, part))
