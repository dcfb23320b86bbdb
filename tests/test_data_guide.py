"""docs/guide/data.md runs as written: its ``python`` blocks' examples, in order, in one namespace.

Each block is a doctest (``>>>`` lines and their output); the page's blocks
share their names, as a reader running them one after another would.
"""

import doctest
import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "data.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_the_page_shows_every_kind_of_data():
    text = "".join(blocks())
    for name in ("ArrayDataset", "IterableDataset", "GrainDataset", "from_iter_dataset",
                 "datasets.Dataset.from_dict"):
        assert name in text


def test_every_example_of_the_page_runs_as_shown():
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    names: dict = {}
    for i, block in enumerate(blocks()):
        test = parser.get_doctest(block, names, f"data.md block {i}", str(PAGE), 0)
        runner.run(test, clear_globs=False)
        names = test.globs
    assert runner.summarize(verbose=False).failed == 0
