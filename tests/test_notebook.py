"""The README's notebook example (tests/notebooks/quickstart.ipynb), executed in a Jupyter kernel.

It builds the tiny model, generates with the notebook progress bar, re-creates the engine in a
later cell, chats, and starts a tensor-parallel engine from a cell; every cell must run. Needs
the test extra (nbclient, ipykernel, ipywidgets).
"""
import os

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "tests", "notebooks", "quickstart.ipynb")


def cell_starting(nb, text: str):
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(text)]
    return cell


def result_text(cell) -> str:
    (result,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    return result.data["text/plain"]


def stdout(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def widget_tree(nb, model_id: str) -> list[dict]:
    """The widget models under `model_id` (tqdm's notebook bar: HBox of HTML, FloatProgress, HTML)."""
    state = nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    model = state[model_id]
    children = [c.removeprefix("IPY_MODEL_") for c in model["state"].get("children", [])]
    return [model, *(m for c in children for m in widget_tree(nb, c))]


def test_the_shipped_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_quickstart_notebook_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel imports this checkout's nanoserve, like the test session does.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute(env=env)

    generate = cell_starting(nb, "llm = LLM(model_dir, max_model_len=512)")
    # The progress bar is tqdm's notebook widget, and it reached the end.
    (bar,) = [o for o in generate.outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert bar.data["text/plain"].startswith("Generating")
    models = widget_tree(nb, bar.data["application/vnd.jupyter.widget-view+json"]["model_id"])
    (progress,) = [m["state"] for m in models if m["model_name"] == "FloatProgressModel"]
    assert progress["value"] == progress["max"] == 3 and progress["bar_style"] == "success"
    # Outputs print short: token lists and texts elided, whatever their length.
    shown = result_text(generate)
    assert shown.startswith("RequestOutput(request_id='0', prompt='Hello, my name is'") and len(shown) < 1000
    assert "(32 ids)" in shown

    assert len(stdout(cell_starting(nb, "for out in outputs:")).splitlines()) == 3
    assert len(stdout(cell_starting(nb, 'llm = LLM(model_dir, dtype="float32"')).splitlines()) == 3

    chat = cell_starting(nb, "replies = llm.chat(")
    assert "<|im_start|>user\nHi!<|im_end|>" in stdout(chat)
    assert result_text(chat).startswith("CompletionOutput(index=0, text=")

    # The tensor-parallel engine started from a cell gives the single-process engine's tokens.
    assert result_text(cell_starting(nb, "with LLM(")) == "True"
