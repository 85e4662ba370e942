"""Every `spillway ...` command the README shows (in its shell blocks and inline) names a
command and options that the CLI has: a renamed flag or a removed subcommand fails here, not
in a newcomer's terminal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command

from spillway_api.cli import build_app

README = Path(__file__).resolve().parents[2] / "README.md"
SHELL_OPERATORS = {">", ">>", "<", "|", "||", "&&", ";", "&", "2>&1"}


def readme_invocations() -> list[str]:
    text = README.read_text()
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        found += [line.strip() for line in block.splitlines() if line.strip().startswith("spillway ")]
    found += [span for span in re.findall(r"`([^`\n]+)`", text) if span.startswith("spillway ")]
    return list(dict.fromkeys(found))  # each once


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
    lines = readme_invocations()
    assert len(lines) >= 12 and any(line.startswith("spillway plan") for line in lines), lines


@pytest.mark.parametrize("line", readme_invocations())
def test_every_command_in_the_readme_exists_with_its_options(line: str) -> None:
    assert check(get_command(build_app()), line) == []


def test_a_renamed_option_or_command_would_be_caught() -> None:
    root = get_command(build_app())
    assert check(root, "spillway plan --params 13B --gpu-memory 24GiB") == []
    assert check(root, "spillway plan --gpu-mem 24GiB") == ["spillway plan has no option --gpu-mem"]
    assert check(root, "spillway jobs resubmit -n a") == ["spillway jobs has no command 'resubmit'"]
