"""The walkthrough notebook runs top to bottom and prints the book's demos exactly."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "walkthrough.ipynb"


def printed(nb) -> str:
    """Everything the notebook's code cells printed. The kernel sends stdout in pieces as it
    flushes (every 0.2 s): a cell's pieces join into what the reader sees."""
    return "\n".join("".join(o.text for o in c.outputs if o.get("name") == "stdout")
                     for c in nb.cells if c.cell_type == "code")


def assert_the_books_demos(text: str) -> None:
    assert ("before allreduce:\n  [[1.0, 1.0]] on cpu:0\n  [[2.0, 2.0]] on cpu:1\n"
            "after allreduce:\n  [[3.0, 3.0]] on cpu:0\n  [[3.0, 3.0]] on cpu:1") in text
    assert ("output: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] on cpu:0\n"
            "output: [[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]] on cpu:1") in text
    assert "parameters: 129068" in text and "replicas identical: True" in text
    assert text.count("test acc") >= 4


def test_the_committed_notebook_carries_the_outputs_of_a_whole_run():
    """A reader on a code host sees the book's figures without running it: every code cell
    ran, top to bottom, in one kernel."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
    assert_the_books_demos(printed(nb))


# The committed outputs come from the whole run (the test above); here LeNet trains 1 epoch on
# a tenth of the notebook's slice, and the ResNet cell trains ResNet-18's code narrowed
# (tests/tiny_resnet.py, whose compile is a fraction of ResNet-18's), which runs the same code.
SMALLER = {"limit=6000": "limit=600", "limit=2000": "limit=200", "epochs=3": "epochs=1",
           "train_examples=6000, test_examples=2000": "train_examples=600, test_examples=200",
           'model="resnet18"': 'model="tests.tiny_resnet"'}


def test_the_notebook_runs_and_prints_the_books_demos(monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for old, new in SMALLER.items():
        (cell,) = [c for c in nb.cells if old in c.source]
        cell.source = cell.source.replace(old, new)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(  # The kernel imports tests.tiny_resnet.
        [str(NOTEBOOK.parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]))
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    assert_the_books_demos(printed(nb))
