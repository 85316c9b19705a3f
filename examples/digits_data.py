"""scikit-learn's handwritten digits (8x8 images, 10 classes), split as every
example splits them: 1197 training and 600 test images.

It reads the table that ships inside scikit-learn instead of calling
`sklearn.datasets.load_digits`: importing scikit-learn pulls in SciPy, about
1.7 s of CPU in every process, more than some examples spend training. The
table holds one image per row, 64 pixels (0-16) then the label;
tests/test_training.py checks that it reads what `load_digits` returns.
"""

import importlib.util
from pathlib import Path

import numpy as np


def digits(seed=0):
    """(x_train, y_train, x_test, y_test) as NumPy arrays: float32 pixels in
    [0, 1] and int64 labels, in the order of a permutation seeded by `seed`.

    Raises ModuleNotFoundError without scikit-learn (the data comes with it).
    """
    pixels, labels = load_digits()
    order = np.random.default_rng(seed).permutation(len(labels))
    x, y = (pixels[order] / 16.0).astype(np.float32), labels[order]
    return x[:1197], y[:1197], x[1197:], y[1197:]


def load_digits():
    """(pixels, labels): the 1797 images as float64 rows of 64 pixels and
    their int64 labels, as `sklearn.datasets.load_digits` gives them.

    Raises ModuleNotFoundError without scikit-learn.
    """
    package = importlib.util.find_spec("sklearn")   # finds the package without importing it
    if package is None:
        raise ModuleNotFoundError("the digits data set comes with scikit-learn: pip install scikit-learn")
    table = Path(package.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not table.exists():   # a scikit-learn that keeps its data elsewhere
        from sklearn.datasets import load_digits as load
        data = load()
        return data.data, data.target.astype(np.int64)
    rows = np.loadtxt(table, delimiter=",")
    return rows[:, :-1], rows[:, -1].astype(np.int64)
