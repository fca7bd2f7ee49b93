"""Handwritten-style digits as Poisson spike trains, classified by a recurrent LIF network online.

The 8×8 digit images come from a package already installed, never from the network:

* ``--source sklearn``: scikit-learn's ``load_digits`` (1,797 handwritten digits that ship
  inside scikit-learn; ``pip install scikit-learn``);
* ``--source fonts``: digits rendered from the TrueType fonts that ship inside matplotlib
  (DejaVu, STIX, Computer Modern: about twenty typefaces), each randomly rotated, scaled,
  sheared and shifted, then downsampled to 8×8 like ``load_digits``;
* ``--source auto`` (the default) takes scikit-learn's digits when it is installed, else the fonts.

Each pixel becomes one input channel that spikes with probability ``intensity · --max-rate``
per step for ``--steps`` steps (rate coding). The network (:class:`_common.LIFNetwork`,
64 → ``--hidden`` :class:`braintrace.nn.LIF` neurons with trainable time constants → 10 readout
units) learns online, one gradient per step (D-RTRL by default, the gradient's norm clipped at
``--grad-clip``); the prediction is the class with the largest mean readout over the second half.

Run ``python examples/digits_spiking.py`` (about a minute on two cores) or with
``--iterations 30`` for a quick look.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from _common import (  # the shared helpers beside this script
    History,
    LIFNetwork,
    common_parser,
    plot_histories,
    positive_float,
    positive_int,
    predict,
    pyplot,
    rate_spikes,
    save_figure,
    train_learners,
    window_accuracy,
)

#: Font files of matplotlib that have no usable digits (symbol, extension and fallback fonts).
_NON_TEXT_FONTS = ("STIXSiz", "STIXNonUni", "cmex", "cmsy", "cmmi", "LastResort", "DejaVuSansDisplay",
                   "DejaVuSerifDisplay")


def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits: images ``(n, 8, 8)`` in [0, 1] and labels ``(n,)``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError("--source sklearn needs scikit-learn (pip install scikit-learn); "
                          "--source fonts needs only matplotlib.") from err
    digits = load_digits()
    return digits.images.astype(np.float32) / 16.0, digits.target.astype(np.int64)


def _glyphs(size: int = 24) -> list[np.ndarray]:
    """One ``(size, size)`` image in [0, 1] per (font, digit), font-major: digit ``d`` is at index ``k*10 + d``."""
    import matplotlib
    from matplotlib import ft2font

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    glyphs = []
    for path in sorted(folder.glob("*.ttf")):
        if path.name.startswith(_NON_TEXT_FONTS):
            continue
        font = ft2font.FT2Font(str(path))
        if any(font.get_char_index(ord(str(d))) == 0 for d in range(10)):
            continue
        font.set_size(48, 72)
        for d in range(10):
            font.set_text(str(d), 0.0)
            font.draw_glyphs_to_bitmap()
            glyphs.append(_fit(np.asarray(font.get_image(), np.float32) / 255.0, size))
    return glyphs


def _fit(img: np.ndarray, size: int) -> np.ndarray:
    """Crop to the ink, pad to a square and resample to ``(size, size)``, keeping a margin."""
    rows, cols = np.nonzero(img > 0.1)
    img = img[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    side = max(img.shape)
    square = np.zeros((side, side), np.float32)
    r0, c0 = (side - img.shape[0]) // 2, (side - img.shape[1]) // 2
    square[r0:r0 + img.shape[0], c0:c0 + img.shape[1]] = img
    from scipy import ndimage

    inner = int(size * 0.8)
    out = np.zeros((size, size), np.float32)
    off = (size - inner) // 2
    out[off:off + inner, off:off + inner] = ndimage.zoom(square, inner / side, order=1)[:inner, :inner]
    return np.clip(out, 0.0, 1.0)


def font_digits(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` digits rendered from matplotlib's fonts with random affine distortions: ``(n, 8, 8)``, ``(n,)``.

    Examples
    --------
    >>> images, labels = font_digits(20, seed=0)
    >>> images.shape, labels[:10].tolist(), bool(0.0 <= images.min() and images.max() <= 1.0)
    ((20, 8, 8), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], True)
    """
    from scipy import ndimage

    glyphs = _glyphs()
    n_fonts = len(glyphs) // 10
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 10
    images = np.empty((n, 8, 8), np.float32)
    size = glyphs[0].shape[0]
    centre = np.array([size / 2, size / 2])
    for i, d in enumerate(labels):
        glyph = glyphs[rng.integers(n_fonts) * 10 + d]
        angle = np.deg2rad(rng.uniform(-12, 12))
        scale = rng.uniform(0.85, 1.15)
        shear = rng.uniform(-0.2, 0.2)
        rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        matrix = rot @ np.array([[1.0, shear], [0.0, 1.0]]) / scale
        offset = centre - matrix @ centre + rng.uniform(-1.5, 1.5, 2)
        warped = ndimage.affine_transform(glyph, matrix, offset=offset, order=1)
        pooled = warped.reshape(8, size // 8, 8, size // 8).mean(axis=(1, 3))
        images[i] = np.clip(pooled / max(pooled.max(), 1e-6), 0.0, 1.0)
    return images, labels.astype(np.int64)


def load_images(source: str, n_fonts_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """Images and labels from ``source`` (``'auto'``, ``'sklearn'`` or ``'fonts'``) and a description."""
    if source == "auto":
        try:
            import sklearn  # noqa: F401
        except ImportError:
            source = "fonts"
        else:
            source = "sklearn"
    if source == "sklearn":
        images, labels = sklearn_digits()
        return images, labels, "scikit-learn's load_digits"
    images, labels = font_digits(n_fonts_samples, seed)
    return images, labels, "digits rendered from matplotlib's fonts"


def encode(rng: np.random.Generator, images: np.ndarray, labels: np.ndarray, n_steps: int,
           max_rate: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rate-coded spikes ``(steps, n, 64)``, labels ``(steps, n)`` and loss weights (second half) ``(steps,)``."""
    xs = rate_spikes(rng, images.reshape(len(images), -1) * max_rate, n_steps)
    ys = np.broadcast_to(labels.astype(np.int32), (n_steps, len(labels))).copy()
    weights = np.zeros(n_steps, np.float32)
    weights[n_steps // 2:] = 1.0
    return xs, ys, weights


def main(argv: list[str] | None = None) -> dict[str, History]:
    """Train each learner on the spiking digits; returns ``learner -> History``."""
    parser = common_parser(__doc__, iterations=300, batch=32, lr=0.01, algorithms=["d_rtrl"],
                           plot="digits_spiking.png", test_size=300, grad_clip=1.0)
    parser.add_argument("--source", choices=["auto", "sklearn", "fonts"], default="auto", help="where the images come from")
    parser.add_argument("--hidden", type=positive_int, default=64, help="recurrent LIF neurons")
    parser.add_argument("--steps", type=positive_int, default=20, help="time steps per image")
    parser.add_argument("--max-rate", type=positive_float, default=0.5, help="spike probability per step of a white pixel")
    parser.add_argument("--font-samples", type=positive_int, default=2000, help="images to render for --source fonts")
    args = parser.parse_args(argv)
    if args.max_rate > 1:
        parser.error(f"--max-rate is a probability per step, got {args.max_rate}; give a value in (0, 1]")
    images, labels, source = load_images(args.source, args.font_samples, args.seed)
    order = np.random.default_rng(args.seed).permutation(len(images))
    n_test = min(args.test_size, len(images) // 4)
    test_idx, train_idx = order[:n_test], order[n_test:]
    if len(train_idx) < args.batch:
        raise ValueError(f"--batch {args.batch} is larger than the {len(train_idx)} training images; lower it.")
    print(f"{source}: {len(train_idx)} training and {n_test} held-out images, {args.steps} steps each")

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(args.seed + 1)
        while True:  # epochs of shuffled batches, fresh spikes every time
            perm = rng.permutation(train_idx)
            for start in range(0, len(perm) - args.batch + 1, args.batch):
                idx = perm[start:start + args.batch]
                yield encode(rng, images[idx], labels[idx], args.steps, args.max_rate)

    test = encode(np.random.default_rng(args.seed + 10_000), images[test_idx], labels[test_idx], args.steps,
                  args.max_rate)
    results = train_learners(
        args.algorithms,
        lambda: LIFNetwork(64, args.hidden, 10, tau=8.0, in_scale=3.0, rec_scale=0.5, seed=args.seed),
        args.batch, args.lr, np.zeros((args.batch, 64), np.float32), batches, args.iterations, window_accuracy, test,
        args.pp_decay, args.grad_clip or None)
    histories = {name: r[2] for name, r in results.items()}
    if args.plot:
        _plot(histories, results, images[test_idx], test, args.plot)
    return histories


def _plot(histories: dict[str, History], results: dict[str, Any], images: np.ndarray,
          test: tuple[np.ndarray, np.ndarray, np.ndarray], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    xs, labels, weights = test
    name, (_, trainer, _) = next(iter(results.items()))
    pred = np.einsum("t,tbc->bc", weights, predict(trainer, xs)).argmax(-1)
    fig = plt.figure(figsize=(14, 3.8))
    grid = fig.add_gridspec(2, 8)
    plot_histories(fig.add_subplot(grid[:, 0:2]), fig.add_subplot(grid[:, 2:4]), histories, chance=0.1)
    for k in range(4):
        ax = fig.add_subplot(grid[k // 2, 4 + k % 2])
        ax.imshow(images[k], cmap="gray_r", vmin=0, vmax=1)
        ax.set_title(f"{labels[-1, k]} → {pred[k]}", fontsize=9, color="k" if pred[k] == labels[-1, k] else "r")
        ax.axis("off")
    raster = fig.add_subplot(grid[:, 6:8])
    t, c = np.nonzero(xs[:, 0])
    raster.scatter(t, c, s=4, color="k")
    raster.set(xlabel="time step", ylabel="pixel (input channel)", title=f"spike code of the first digit ({name})")
    save_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])
