"""Every notebook in notebooks/ is stored clean and runs top to bottom without an error."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  names = {p.stem for p in NOTEBOOKS}
  assert {
    "01_quickstart",
    "02_data_parallel",
    "03_batch_size_schedules",
    "04_from_keras_and_caffe",
    "05_sync_vs_async",
    "06_sharded_training",
    "07_how_big_a_batch",
  } <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_clean_with_badge_and_install_cell(path):
  nb = nbformat.read(path, as_version=4)
  assert "colab.research.google.com" in nb.cells[0].source and "Open In Colab" in nb.cells[0].source
  assert nb.cells[1].cell_type == "code" and "pip" in nb.cells[1].source and "jaxaccum" in nb.cells[1].source
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, f"{path.name} is stored with outputs"


@pytest.mark.slow  # a kernel per notebook, every cell executed
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.chdir(tmp_path)  # anything a notebook writes lands in a temporary folder
  nb = nbformat.read(path, as_version=4)
  # ipykernel's native 'python3' kernel is this interpreter, so it sees the installed jaxaccum.
  client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
