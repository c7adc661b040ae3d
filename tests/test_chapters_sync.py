"""Chapters: each reviewed `chapters/NN_slug.py` (jupytext percent) and its committed `.ipynb` say the same thing.

Regenerate-and-diff: the notebook is rebuilt from the .py with jupytext and its cells (types and sources)
must equal the committed notebook's, which must carry no outputs and keep the Colab metadata. Every
chapter's first code cell installs the package on Colab only, from the one repository URL in pyproject.
"""

import json
import re
from pathlib import Path

import jupytext
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
REQUIRED = ["00_first_generation", "01_tokenization_and_queue", "02_kv_cache", "03_paged_blocks",
            "04_continuous_batching", "05_sampling", "06_prefix_caching", "07_speculative_decoding",
            "08_triton_kernels", "09_serving"]


def repository_url() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Repository"]


def cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def test_the_required_chapters_exist():
    assert [p.stem for p in CHAPTERS][: len(REQUIRED)] == REQUIRED
    assert not sorted((ROOT / "chapters").glob("*.ipynb")) or all(
        nb.with_suffix(".py").is_file() for nb in (ROOT / "chapters").glob("*.ipynb")), "a notebook without its .py"


@pytest.mark.parametrize("py", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_notebook_matches_its_source(py):
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{ipynb.name} is missing: run `jupytext --sync {py.relative_to(ROOT)}`"
    regenerated = jupytext.reads(py.read_text(encoding="utf-8"), fmt="py:percent")
    committed = jupytext.read(ipynb)
    assert cells(regenerated) == cells(committed), (
        f"{ipynb.name} differs from {py.name}: run `jupytext --sync {py.relative_to(ROOT)}`")


@pytest.mark.parametrize("py", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_committed_notebook_is_clean_and_colab_ready(py):
    raw = json.loads(py.with_suffix(".ipynb").read_text(encoding="utf-8"))
    for cell in raw["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, "commit notebooks without outputs"
    meta = raw["metadata"]
    assert meta.get("accelerator") == "GPU" and "colab" in meta, "Colab metadata (GPU runtime) must survive"
    assert meta["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("py", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_setup_cell_installs_from_the_one_repository_url(py):
    nb = jupytext.reads(py.read_text(encoding="utf-8"), fmt="py:percent")
    setup = next(c.source for c in nb.cells if c.cell_type == "code")
    assert 'if "google.colab" in sys.modules:' in setup, "the setup cell must do nothing outside Colab"
    urls = re.findall(r"https?://[^\s\"')]+", setup)
    assert urls == [repository_url()], f"setup cell URLs {urls} must be exactly pyproject's Repository URL"
    # an editable install of a clone, or (chapter 00) one pip install of the repository itself
    assert '"pip", "install"' in setup and ('"-e"' in setup or "git+{REPO}" in setup)
    # the URL lives only in that cell: nowhere else in the chapter
    rest = "\n".join(c.source for c in nb.cells if c.source is not setup)
    assert repository_url() not in rest
