"""The walkthrough notebook runs top to bottom and prints the book's demos exactly."""

import json
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "walkthrough.ipynb"


def test_the_committed_notebook_has_no_outputs():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in cells if c["cell_type"] == "code")


def test_the_notebook_runs_and_prints_the_books_demos():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    # The kernel sends stdout in pieces as it flushes (every 0.2 s): a cell's pieces join
    # into what the reader sees.
    text = "\n".join("".join(o.text for o in c.outputs if o.get("name") == "stdout")
                     for c in nb.cells if c.cell_type == "code")
    assert ("before allreduce:\n  [[1.0, 1.0]] on cpu:0\n  [[2.0, 2.0]] on cpu:1\n"
            "after allreduce:\n  [[3.0, 3.0]] on cpu:0\n  [[3.0, 3.0]] on cpu:1") in text
    assert ("output: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] on cpu:0\n"
            "output: [[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]] on cpu:1") in text
    assert "parameters: 129068" in text and "replicas identical: True" in text
    assert text.count("test acc") >= 4
