"""Every flag the README and docs name is one that the command they name it for accepts."""

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command line of ours, up to a shell comment, a table cell's end or the end of a code span.
COMMAND = re.compile(r"python -m (experiments\.\w+)([^`|#\n]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w])")
# Flags the docs give to other programs, by program.
OTHERS = {"apt-get": {"--reinstall"}, "mpirun": {"--bind-to"}, "srun": {"--kill-on-bad-exit"}}


def commands(text: str):
    """(module, its arguments) of each command line in text; a launcher's command too."""
    text = text.replace("\\\n", " ").replace(" -- ", "\n")
    for m in COMMAND.finditer(text):
        # A model of the reader's own stands for a module like tests/tiny_mlp.py.
        yield m.group(1), m.group(2).replace("my_package.my_model", "tests.tiny_mlp").split()


def accepted(module: str, args: list[str], monkeypatch) -> set[str]:
    """The flags module's parser takes, given args (a --model changes them)."""
    monkeypatch.setattr(sys, "argv", [module, *args])
    return set(importlib.import_module(module).parser()._option_string_actions)


def test_every_flag_the_docs_give_a_command_is_one_it_takes(monkeypatch):
    """Catches a documented flag that ends in `unrecognized arguments` (--conv-grads did)."""
    wrong, found = [], 0
    for doc in DOCS:
        for module, args in commands(doc.read_text()):
            takes = accepted(module, args, monkeypatch)
            for flag in (a.split("=")[0] for a in args if FLAG.fullmatch(a.split("=")[0])):
                found += 1
                if flag not in takes:
                    wrong.append(f"{doc.name}: {module} {flag}")
    assert found > 100 and not wrong


def test_every_flag_the_docs_name_alone_is_taken_by_a_command(monkeypatch):
    """A flag named in prose (`--conv-grads xla`) belongs to one of the commands."""
    modules = {m.stem for m in (ROOT / "experiments").glob("*.py")
               if "def parser(" in m.read_text() and "__main__" in m.read_text()}
    takes = set().union(*(accepted(f"experiments.{m}", [], monkeypatch) for m in modules))
    for model in ("resnet18", "tests.tiny_mlp"):  # Their own options' flags.
        takes |= accepted("experiments.train", ["--model", model], monkeypatch)
    others = set().union(*OTHERS.values())
    named = {f for doc in DOCS for span in re.findall(r"`([^`\n]+)`", doc.read_text())
             for f in FLAG.findall(span)}
    assert len(named) > 40 and sorted(named - takes - others) == []
