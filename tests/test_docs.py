"""The documentation holds together: README.md and every docs/**/*.md page link only to files that exist
and to headings that exist, README stays a first page (short, with CI's test command), and every docs
page is reachable from README. Offline and fast: it reads markdown, nothing else."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 260
# .ci/run greps README.md for this exact string: CI runs what README tells a user to run.
CI_TEST_COMMAND = 'python -m pip install torch==2.13.0 -e ".[dev]" && python -m pytest'

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(?:.+?)\1")
# The "](target)" of an inline link or image, whatever its text (which may itself hold brackets or an
# image); an optional title follows the target.
INLINE_TARGET = re.compile(r"\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")
URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for each line outside fenced code blocks, inline code spans blanked out."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            continue
        if fence is not None:
            # a fence closes with a run of the same character at least as long as the one that opened it
            closing = FENCE.match(line)
            if closing and closing.group(1)[0] == fence[0] and len(closing.group(1)) >= len(fence):
                if not line.strip().strip(fence[0]):
                    fence = None
            continue
        out.append((number, INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text (no link targets, no code or emphasis marks),
    lowercased, every character that is not a letter, digit, space, hyphen or underscore dropped, spaces
    turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags render as nothing
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w: unicode letters, digits and the underscore
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub gives the page: one per heading, repeats numbered -1, -2, ... in order, plus
    explicit <a name=...> or <a id=...> anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_targets(page: Path) -> list[tuple[int, str]]:
    """(line number, target) for every relative link or image of the page, outside code."""
    out: list[tuple[int, str]] = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        targets = [m.group(1) for m in INLINE_TARGET.finditer(line)]
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            targets.append(definition.group(1))
        for target in targets:
            target = target.strip("<>")
            if URL_SCHEME.match(target) or target.startswith("//"):
                continue  # http(s), mailto, ...: not checked offline
            out.append((number, target))
    return out


def broken_links(page: Path, repo: Path = REPO) -> list[str]:
    """One 'file:line: target: why' for each link of the page that points at nothing."""
    problems: list[str] = []
    where = page.relative_to(repo) if page.is_relative_to(repo) else page
    anchor_cache: dict[Path, set[str]] = {}
    for number, target in link_targets(page):
        path_part, _, fragment = target.partition("#")
        path_part = unquote(path_part)
        if not path_part:
            resolved = page
        elif path_part.startswith("/"):
            resolved = repo / path_part.lstrip("/")  # GitHub resolves "/x" from the repository's root
        else:
            resolved = (page.parent / path_part).resolve()
        if not resolved.exists():
            problems.append(f"{where}:{number}: ({target}): no file or folder {path_part!r} next to this page")
            continue
        if fragment and resolved.is_file() and resolved.suffix == ".md":
            if resolved not in anchor_cache:
                anchor_cache[resolved] = anchors(resolved)
            if unquote(fragment) not in anchor_cache[resolved]:
                problems.append(
                    f"{where}:{number}: ({target}): no heading of {resolved.name} has the anchor #{fragment}"
                )
    return problems


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = [problem for page in pages() for problem in broken_links(page)]
    assert not problems, f"{len(problems)} broken link(s):\n" + "\n".join(problems)


def test_readme_is_a_first_page_that_shows_the_ci_command() -> None:
    text = README.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move reference material into docs/"
    )
    assert CI_TEST_COMMAND in text, (
        f"README.md must show CI's test command exactly (.ci/run greps for it): {CI_TEST_COMMAND}"
    )


def test_every_docs_page_is_linked_from_readme() -> None:
    linked = set()
    for _, target in link_targets(README):
        path_part = unquote(target.partition("#")[0])
        if path_part:
            linked.add((README.parent / path_part).resolve())
    unlinked = [str(page.relative_to(REPO)) for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, "docs page(s) not linked from README.md: " + ", ".join(unlinked)


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Checkpoints, preemption and resume", "checkpoints-preemption-and-resume"),
        ("`--mixed_precision auto`: what it picks", "--mixed_precision-auto-what-it-picks"),
        ("A worked example: the default job, seen", "a-worked-example-the-default-job-seen"),
        ("The [bench](bench.md) and its 2.25x", "the-bench-and-its-225x"),
        ("Résumé — élan", "résumé--élan"),
    ],
)
def test_slug_follows_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_the_checker_names_each_broken_link(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Part\n\n## Part\n", encoding="utf-8")
    (tmp_path / "page.md").write_text(
        "# Page\n"
        "[fine](other.md#part-1) [fine](#page) ![fine](other.md) [web](https://example.com/x.md)\n"
        "[gone](missing.md) `[code](not-a-link.md)`\n"
        "```\n[fenced](not-a-link-either.md)\n```\n"
        "[bad anchor](other.md#part-2) [bad here](#nowhere)\n",
        encoding="utf-8",
    )
    problems = broken_links(tmp_path / "page.md", repo=tmp_path)
    assert [p.split(":")[1] for p in problems] == ["3", "7", "7"], problems
    assert "missing.md" in problems[0] and "#part-2" in problems[1] and "#nowhere" in problems[2]


# The project's own tracker is not part of the repository, so a reader of the code or the docs cannot
# follow "issue 45" anywhere; nor can they open the design notes kept outside it. The repository's own
# design page is docs/design.md, cited by that path.
OWN_ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
OUTSIDE_DESIGN_NOTES = re.compile(r"DESIGN\.md")  # case-sensitive: `docs/design.md` is the repository's page


def cited_from_outside(text: str) -> list[tuple[int, str]]:
    """(line number, what it cites) for each citation of our own issue tracker ("issue 45", "Issue #57",
    "issues 45 and 55") and each "DESIGN.md". An upstream project's tracker, cited as the project's name
    and the number ("transformers #17106", "pytorch#126750", "marin-community/marin#2829") or by its URL
    (".../issues/123"), is public and followable, and does not match: the word "issue" followed by a
    number is what marks a citation of ours, so write upstream ones without it."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        hits += [(number, m.group(0)) for m in OWN_ISSUE.finditer(line)]
        hits += [(number, m.group(0)) for m in OUTSIDE_DESIGN_NOTES.finditer(line)]
    return hits


def test_docs_and_package_cite_nothing_outside_the_repository() -> None:
    """Every .py under mlm_ddp/ and under tests/ (their comments and docstrings: simply the file's text),
    README.md and every .md under docs/ say what is and why without citing an issue number or DESIGN.md.
    This file is left out: its examples of what the check finds cite issues on purpose."""
    tests = [path for path in sorted((REPO / "tests").rglob("*.py")) if path != Path(__file__).resolve()]
    files = [*sorted((REPO / "mlm_ddp").rglob("*.py")), *tests, README, *sorted(DOCS.rglob("*.md"))]
    problems = [
        f"{path.relative_to(REPO)}:{number}: {cited!r}"
        for path in files
        for number, cited in cited_from_outside(path.read_text(encoding="utf-8"))
    ]
    assert not problems, (
        f"{len(problems)} citation(s) of our issue tracker or of DESIGN.md, neither of which is in the repository "
        "(say what is and why; cite docs/design.md by its path):\n" + "\n".join(problems)
    )


def test_the_citation_check_tells_ours_from_upstream() -> None:
    text = (
        "fixed in issue 46\n"  # 1
        "See Issue #57 and issues 45 and 55.\n"  # 2
        "(DESIGN.md, pitfall 15)\n"  # 3
        "(docs/design.md, pitfall 15) transformers #31035, pytorch#126750, marin-community/marin#2829\n"  # 4
        "https://github.com/huggingface/datasets/issues/6623 and a tissue 12 and reissue 3\n"  # 5
    )
    assert cited_from_outside(text) == [(1, "issue 46"), (2, "Issue #57"), (2, "issues 45"), (3, "DESIGN.md")]
