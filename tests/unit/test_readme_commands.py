"""Every `spillway ...` command the README and the docs/ pages show (in their shell blocks and
inline) names a command and options that the CLI has: a renamed flag or a removed subcommand
fails here, naming the file, not in a newcomer's terminal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command

from spillway_api.cli import build_app

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL_OPERATORS = {">", ">>", "<", "|", "||", "&&", ";", "&", "2>&1"}


def invocations(page: Path) -> list[str]:
    """The `spillway ...` commands one page shows, each once."""
    text = page.read_text()
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        found += [line.strip() for line in block.splitlines() if line.strip().startswith("spillway ")]
    found += [span for span in re.findall(r"`([^`\n]+)`", text) if span.startswith("spillway ")]
    return list(dict.fromkeys(found))


def shown_commands() -> list[tuple[str, str]]:
    """(file relative to the repository, command) for every page."""
    return [(str(page.relative_to(ROOT)), line) for page in PAGES for line in invocations(page)]


def check(root: Any, line: str) -> list[str]:
    """What of `line` the CLI does not have: an unknown command, or an option its command lacks."""
    tokens = shlex.split(line.replace("…", ""), comments=True)[1:]
    words: list[str] = []
    for token in tokens:
        if token in SHELL_OPERATORS or token.startswith(">"):
            break
        words.append(token)
    command, path = root, ["spillway"]
    while getattr(command, "commands", None) and words and not words[0].startswith("-"):
        sub = command.commands.get(words[0])  # typer's (vendored click) group of commands
        if sub is None:
            return [f"{' '.join(path)} has no command {words[0]!r}"]
        command, path = sub, [*path, words.pop(0)]
    options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}
    return [f"{' '.join(path)} has no option {word.split('=')[0]}" for word in words
            if word.startswith("-") and not re.fullmatch(r"-\d.*", word) and word.split("=")[0] not in options]


def test_the_readme_shows_commands() -> None:
    # The README shows the one-machine path itself; the pages together show the CLI at large.
    readme = invocations(README)
    for name in ("plan", "run", "export"):
        assert any(line.startswith(f"spillway {name} ") for line in readme), (name, readme)
    everywhere = {line for _, line in shown_commands()}
    assert len(everywhere) >= 12, sorted(everywhere)


@pytest.mark.parametrize(("page", "line"), shown_commands())
def test_every_command_in_the_readme_exists_with_its_options(page: str, line: str) -> None:
    assert check(get_command(build_app()), line) == [], f"{page}: {line}"


def test_a_renamed_option_or_command_would_be_caught() -> None:
    root = get_command(build_app())
    assert check(root, "spillway plan --params 13B --gpu-memory 24GiB") == []
    assert check(root, "spillway plan --gpu-mem 24GiB") == ["spillway plan has no option --gpu-mem"]
    assert check(root, "spillway jobs resubmit -n a") == ["spillway jobs has no command 'resubmit'"]
