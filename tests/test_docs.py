"""The documentation stays true to the code: README.md and docs/*.md link only to files and headings that exist,
and every `scaletrain` command line they show names a real command and real flags of that command.

Fast: the pages are read and the CLI's own parser is built; nothing is launched.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote

import pytest

from scaletrain.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Languages of fenced blocks read as shell; a plain fence counts as shell too.
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh", "shell-session"}
# Commands that take `scaletrain ...` as the command they run (`srun ... scaletrain train`).
RUNNERS = {"srun", "mpirun", "mpiexec", "sudo", "env", "time", "nohup", "exec", "xargs", "uv", "pipx"}


def page_id(page: Path, root: Path = ROOT) -> str:
    return page.relative_to(root).as_posix()


# ---------------------------------------------------------------------------------------------------- page reading


class Page:
    """A Markdown page split into prose lines and fenced code blocks, with 1-based line numbers."""

    FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([^\s`{]*)")

    def __init__(self, path: Path, root: Path = ROOT):
        self.path, self.root = path, root
        self.name = page_id(path, root)
        self.prose: list[tuple[int, str]] = []
        self.blocks: list[tuple[str, list[tuple[int, str]]]] = []  # (language, lines)
        fence: str | None = None
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = self.FENCE.match(line)
            if fence is None:
                if m:
                    fence = m.group(1)
                    self.blocks.append((m.group(2).lower(), []))
                else:
                    self.prose.append((number, line))
            elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2):
                fence = None
            else:
                self.blocks[-1][1].append((number, line))

    def anchors(self) -> set[str]:
        """The anchors GitHub gives this page: one per heading (and any explicit HTML id or name)."""
        seen: dict[str, int] = {}
        found: set[str] = set()
        lines = self.prose
        for i, (_, line) in enumerate(lines):
            m = re.match(r"^ {0,3}(#{1,6})(?:\s+(.*?))?\s*$", line)
            text = None
            if m:
                text = re.sub(r"\s+#+\s*$", "", m.group(2) or "")  # an ATX heading's closing #s
            elif (i + 1 < len(lines) and lines[i + 1][0] == lines[i][0] + 1 and line.strip()
                  and re.match(r"^ {0,3}(=+|-+)\s*$", lines[i + 1][1]) and not line.lstrip().startswith(("-", "|"))):
                text = line.strip()  # a setext heading, underlined with === or ---
            if text is not None:
                found.add(unique_slug(slug(text), seen))
            for explicit in re.findall(r"<a\s[^>]*?(?:id|name)=[\"']([^\"']+)[\"']", line):
                found.add(explicit)
        return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, every character other than a letter, a mark, a digit,
    a connector (underscore), a space or a hyphen removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.strip().lower()
    kept = "".join(c for c in text if c in " -" or unicodedata.category(c) in WORD_CATEGORIES)
    return kept.replace(" ", "-")


# Unicode's letters, marks, digits and other numbers, and connector punctuation (the underscore)
WORD_CATEGORIES = {"Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc"}


def unique_slug(base: str, seen: dict[str, int]) -> str:
    """As github-slugger numbers repeated headings: `x`, `x-1`, `x-2`, ..."""
    result = base
    while result in seen:
        seen[base] += 1
        result = f"{base}-{seen[base]}"
    seen[result] = 0
    return result


def without_code_spans(line: str) -> str:
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", line)


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?")


def links(page: Page) -> list[tuple[int, str]]:
    found = []
    for number, line in page.prose:
        line = without_code_spans(line)
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
        found += [(number, m.group(1)) for m in REFERENCE.finditer(line)]
    return found


_anchor_cache: dict[Path, set[str]] = {}


def anchors_of(path: Path) -> set[str]:
    if path not in _anchor_cache:
        _anchor_cache[path] = Page(path, root=path.parent).anchors()
    return _anchor_cache[path]


def link_problems(page: Page) -> list[str]:
    problems = []
    for number, target in links(page):
        where = f"{page.name}:{number}: link ({target})"
        if not target:
            problems.append(f"{where}: empty target")
            continue
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http(s)://, mailto: and other schemes: not checked here
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if path_part:
            base = page.root if path_part.startswith("/") else page.path.parent
            file = (base / path_part.lstrip("/")).resolve()
            if not (file == page.root or page.root in file.parents):
                problems.append(f"{where}: {path_part} is outside the repository")
                continue
            if not file.exists():
                problems.append(f"{where}: no file {page_id(file, page.root)}")
                continue
        else:
            file = page.path
        if anchor:
            if file.is_dir() or file.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor into {file.name}, which is not a Markdown page")
            elif unquote(anchor) not in anchors_of(file):
                problems.append(f"{where}: no heading with anchor #{anchor} in {page_id(file, page.root)} "
                                f"(its anchors: {', '.join(sorted(anchors_of(file)))})")
    return problems


# ------------------------------------------------------------------------------------------------- command lines


def strip_comment(line: str) -> str:
    """The line without a shell comment: a # that starts a word, outside quotes."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def shell_words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: prose in a plain block; words are close enough
        return line.replace("&&", " && ").replace(";", " ; ").replace("|", " | ").split()


def logical_lines(lines: list[tuple[int, str]], prompt: bool) -> list[tuple[int, str]]:
    """Backslash-continued lines joined, each numbered by its first line; comments removed; `$ ` prompts dropped."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in lines:
        if prompt and pending is None:
            line = re.sub(r"^\s*\$\s+", "", line)
        line = strip_comment(line)
        start, text = pending if pending else (number, "")
        if line.rstrip().endswith("\\"):
            pending = (start, text + line.rstrip()[:-1] + " ")
        else:
            pending = None
            joined.append((start, text + line))
    if pending:
        joined.append(pending)
    return joined


def invocations(words: list[str]) -> list[list[str]]:
    """What follows `scaletrain` in each command of a line (commands split at &&, ||, ;, |)."""
    found = []
    command: list[str] = []
    for word in [*words, ";"]:
        if word and set(word) <= set(";&|"):
            i = 0
            while i < len(command) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", command[i]):
                i += 1  # VAR=value before the command
            for j in range(i, len(command)):
                if command[j] == "scaletrain" or command[j].endswith("/scaletrain"):
                    # the command itself, `python -m scaletrain`, `torchrun ... -m scaletrain`, `srun ... scaletrain`
                    if j == i or command[j - 1] == "-m" or Path(command[i]).name in RUNNERS:
                        found.append(command[j + 1:])
                    break
            command = []
        else:
            command.append(word)
    return found


@lru_cache(maxsize=None)
def cli_parser():
    return build_parser()


def flag_problems_in(args: list[str], where: str, bare_ok: bool) -> list[str]:
    parser = cli_parser()
    top_flags = {s for a in parser._actions for s in a.option_strings}
    problems = []
    while args and args[0].startswith("-"):
        if args[0].split("=")[0] not in top_flags:
            return [f"{where}: `scaletrain {args[0]}`: scaletrain has no option {args[0]} "
                    f"(it has {', '.join(sorted(top_flags))})"]
        if args[0] in ("-h", "--help", "--version"):
            return []
        args = args[1:]
    if not args:
        return [] if bare_ok else [f"{where}: `scaletrain` without a command"]
    command, rest = args[0], args[1:]
    if command in ("...", "COMMAND", "<command>"):
        return []
    if command not in parser.commands:
        return [f"{where}: `scaletrain {command}`: no such command (commands: {', '.join(parser.commands)})"]
    current, current_name = parser.commands[command], command
    for word in rest:
        if word == "--":
            if command != "bench":
                problems.append(f"{where}: `scaletrain {command} ... --`: only bench passes words after -- on")
                break
            current, current_name = parser.commands["train"], "train (after bench's --)"
            continue
        if not word.startswith("-") or word == "-" or re.match(r"^-\d", word) or word.strip("-.") == "":
            continue  # a value, a negative number, a placeholder
        flag = word.split("=", 1)[0]
        flags = {s for a in current._actions for s in a.option_strings}
        if flag not in flags:
            close = sorted(f for f in flags if f.startswith(flag[:5]))
            problems.append(f"{where}: `scaletrain {command}`: {flag} is not a flag of {current_name}"
                            + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return problems


def command_problems(page: Page) -> list[str]:
    problems = []
    for language, lines in page.blocks:
        if language not in SHELL_LANGUAGES:
            continue
        for number, line in logical_lines(lines, prompt=language in ("console", "shell-session")):
            for args in invocations(shell_words(line)):
                problems += flag_problems_in(args, f"{page.name}:{number}", bare_ok=False)
    for number, line in page.prose:  # `scaletrain train --nproc N` as inline code in the text and tables
        for code in re.findall(r"(`+)((?:(?!\1).)+?)\1", line):
            for args in invocations(shell_words(strip_comment(code[1].strip()))):
                problems += flag_problems_in(args, f"{page.name}:{number} (inline code)", bare_ok=True)
    return problems


# ------------------------------------------------------------------------------------------------------- the tests


def test_the_pages_are_there():
    names = {page_id(p) for p in PAGES}
    assert "README.md" in names and len(names) > 1, f"docs/ has no pages: {sorted(names)}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_resolve(page):
    problems = link_problems(Page(page))
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_use_real_flags(page):
    problems = command_problems(Page(page))
    assert not problems, "commands the CLI does not have:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_should(tmp_path):
    """The checks themselves: each kind of mistake is found, and the forms that are right are not reported."""
    assert slug("Checking a GPU machine: `benchmarks/gpu_suite.py`") == "checking-a-gpu-machine-benchmarksgpu_suitepy"
    assert slug("Will it fit? `scaletrain estimate-memory`") == "will-it-fit-scaletrain-estimate-memory"
    seen: dict[str, int] = {}
    assert [unique_slug("x", seen) for _ in range(3)] == ["x", "x-1", "x-2"]

    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Usage: `scaletrain train`\n\n## Usage: `scaletrain train`\n\n"
        "[ok](#usage-scaletrain-train-1) [bad](#no-such-heading) [file](missing.md) [web](https://x.org/#y)\n"
        "`[not a link](nowhere.md)`\n\n"
        "```bash\n"
        "scaletrain train --epochs 2 \\\n    --no-such-flag 3   # --also-not-checked: a comment\n"
        "torchrun --standalone --nproc-per-node 2 -m scaletrain train --lr=0.1 && scaletrain predict --epochs 1\n"
        "srun --ntasks-per-node 4 scaletrain trian ...\n"
        "scaletrain bench --nproc 1,2 -- --lr 0.05 --top-k 3\n"
        "pip install 'scaletrain[hf]' && scaletrain --help && python -m scaletrain env\n"
        "[not a link](nowhere.md)\n"
        "```\n\n"
        "Inline: `scaletrain evaluate --split val --bogus`, the `scaletrain` command.\n",
        encoding="utf-8")
    parsed = Page(page, root=tmp_path)
    link_report = "\n".join(link_problems(parsed))
    assert "page.md:7: link (#no-such-heading)" in link_report and "page.md:7: link (missing.md)" in link_report
    assert "link (#usage-scaletrain-train-1)" not in link_report and "x.org" not in link_report
    assert "nowhere.md" not in link_report and len(link_problems(parsed)) == 2, link_report
    flag_report = command_problems(parsed)
    assert any("page.md:11:" in p and "--no-such-flag" in p for p in flag_report), flag_report
    assert any("page.md:13:" in p and "--epochs is not a flag of predict" in p for p in flag_report), flag_report
    assert any("page.md:14:" in p and "trian" in p for p in flag_report), flag_report
    assert any("page.md:15:" in p and "--top-k is not a flag of train" in p for p in flag_report), flag_report
    assert any("inline code" in p and "--bogus" in p for p in flag_report), flag_report
    assert len(flag_report) == 5, flag_report
