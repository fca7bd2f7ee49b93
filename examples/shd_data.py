"""Spike-train classification data in the Spiking Heidelberg Digits (SHD) format: real and synthetic.

A data set is a :class:`SpikeEvents`: per sample, the spike times (seconds) and the input
channel of each spike, plus an integer label. Two sources fill it:

* :func:`load_shd` reads a local SHD HDF5 file (``spikes/times``, ``spikes/units`` — ragged
  arrays, one per sample — and ``labels``), as distributed by the Zenke lab: 700 channels
  (cochlear model fibres), 20 classes (spoken digits 0–9 in English and German). Nothing is
  downloaded: pass the path of a file you already have.
* :func:`synthetic_shd` generates an SHD-like set offline: 700 channels, 20 classes, each class
  a few "formant" bands that sweep across the channels along class-specific paths, with per-
  sample speed, channel shift and jitter, and background spikes.

:func:`bin_events` turns a batch of samples into dense ``(time_steps, batch, channels)`` spike
counts clipped to 1, the input of the networks in the examples.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

__all__ = ["SpikeEvents", "load_shd", "save_shd", "synthetic_shd", "bin_events", "SHD_CHANNELS", "SHD_CLASSES"]

#: Input channels and classes of the Spiking Heidelberg Digits.
SHD_CHANNELS = 700
SHD_CLASSES = 20


class SpikeEvents(NamedTuple):
    """Ragged spike data: ``times[i]`` (seconds) and ``units[i]`` (channel indices) of sample ``i``."""

    times: list[np.ndarray]
    units: list[np.ndarray]
    labels: np.ndarray  # (samples,) int
    n_channels: int

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index: np.ndarray) -> SpikeEvents:
        """The samples at ``index``, in that order."""
        return SpikeEvents([self.times[i] for i in index], [self.units[i] for i in index], self.labels[index],
                           self.n_channels)


def load_shd(path: str | os.PathLike[str], limit: int | None = None) -> SpikeEvents:
    """Read an SHD HDF5 file (``spikes/times``, ``spikes/units``, ``labels``); needs ``h5py``.

    Parameters
    ----------
    path : str or path-like
        A local file such as ``shd_train.h5`` (unzipped).
    limit : int, optional
        Read only the first ``limit`` samples.

    Raises
    ------
    FileNotFoundError
        When ``path`` does not exist.
    ValueError
        When the file lacks one of the three datasets, or their lengths disagree.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_shd: no file at path={os.fspath(path)!r}; give the path of a local SHD "
                                f".h5 file (e.g. shd_train.h5, unzipped). Nothing is downloaded.")
    try:
        import h5py
    except ImportError as err:
        raise ImportError("load_shd needs h5py to read SHD files: pip install h5py") from err
    with h5py.File(path, "r") as f:
        missing = [k for k in ("spikes/times", "spikes/units", "labels") if k not in f]
        if missing:
            raise ValueError(f"load_shd: {os.fspath(path)!r} is not an SHD file: it lacks the dataset(s) {missing} "
                             f"(expected 'spikes/times', 'spikes/units' and 'labels').")
        n = len(f["labels"]) if limit is None else min(limit, len(f["labels"]))
        times = [np.asarray(t, dtype=np.float64) for t in f["spikes/times"][:n]]
        units = [np.asarray(u, dtype=np.int64) for u in f["spikes/units"][:n]]
        labels = np.asarray(f["labels"][:n], dtype=np.int64)
    if not len(times) == len(units) == len(labels):
        raise ValueError(f"load_shd: {os.fspath(path)!r} has {len(times)} spike-time arrays, {len(units)} unit arrays "
                         f"and {len(labels)} labels; they must match.")
    n_channels = max(SHD_CHANNELS, 1 + max((int(u.max()) for u in units if u.size), default=0))
    return SpikeEvents(times, units, labels, n_channels)


def save_shd(path: str | os.PathLike[str], data: SpikeEvents) -> None:
    """Write ``data`` as an SHD-format HDF5 file (ragged ``spikes/times`` float, ``spikes/units`` uint16, ``labels``)."""
    import h5py

    with h5py.File(path, "w") as f:
        spikes = f.create_group("spikes")
        t = spikes.create_dataset("times", (len(data),), dtype=h5py.vlen_dtype(np.float16))
        u = spikes.create_dataset("units", (len(data),), dtype=h5py.vlen_dtype(np.uint16))
        for i in range(len(data)):
            t[i] = data.times[i].astype(np.float16)
            u[i] = data.units[i].astype(np.uint16)
        f.create_dataset("labels", data=data.labels.astype(np.uint16))


def _class_templates(rng: np.random.Generator, n_classes: int, n_channels: int, bands: int) -> np.ndarray:
    """Per class and band: start channel, drift (channels per unit time), wobble amplitude, frequency, phase."""
    start = rng.uniform(0.1, 0.9, (n_classes, bands)) * n_channels
    drift = rng.uniform(-0.4, 0.4, (n_classes, bands)) * n_channels
    wobble = rng.uniform(0.0, 0.15, (n_classes, bands)) * n_channels
    freq = rng.uniform(0.5, 2.0, (n_classes, bands))
    phase = rng.uniform(0, 2 * np.pi, (n_classes, bands))
    return np.stack([start, drift, wobble, freq, phase], axis=-1)


def synthetic_shd(
    n_samples: int,
    seed: int = 0,
    n_classes: int = SHD_CLASSES,
    n_channels: int = SHD_CHANNELS,
    duration: float = 1.0,
    bands: int = 3,
    spikes_per_band: int = 150,
    background: int = 100,
    class_seed: int = 1234,
) -> SpikeEvents:
    """An SHD-like set: ``n_samples`` spike trains over ``n_channels`` channels, ``n_classes`` classes.

    Each class is ``bands`` bands whose channel centre follows
    ``start + drift·u + wobble·sin(2π·freq·u + phase)`` over the normalised time ``u`` in [0, 1]
    (fixed by ``class_seed``, so train and test sets built with different ``seed`` share the
    classes). A sample stretches its class pattern over a random fraction of ``duration``
    (speed), shifts it by up to ±5 % of the channels, scatters each spike by a few channels and
    adds ``background`` uniformly random spikes. Labels are balanced.

    Examples
    --------
    >>> data = synthetic_shd(4, seed=0)
    >>> len(data), data.n_channels, data.labels.tolist()
    (4, 700, [0, 1, 2, 3])
    >>> bool(all(t.max() <= 1.0 for t in data.times)), bool(all(u.max() < 700 for u in data.units))
    (True, True)
    """
    templates = _class_templates(np.random.default_rng(class_seed), n_classes, n_channels, bands)
    rng = np.random.default_rng(seed)
    labels = np.arange(n_samples) % n_classes
    times, units = [], []
    for label in labels:
        onset = rng.uniform(0.0, 0.15) * duration
        length = rng.uniform(0.6, 0.8) * duration
        shift = rng.uniform(-0.05, 0.05) * n_channels
        n_band = rng.poisson(spikes_per_band, bands)
        u = [rng.uniform(0.0, 1.0, k) for k in n_band]
        t = np.concatenate([onset + length * ui for ui in u])
        centre = np.concatenate([
            s + d * ui + w * np.sin(2 * np.pi * f * ui + p) for (s, d, w, f, p), ui in zip(templates[label], u)
        ])
        ch = centre + shift + rng.normal(0.0, 0.01 * n_channels, centre.shape)
        t = np.concatenate([t, rng.uniform(0.0, duration, background)])
        ch = np.concatenate([ch, rng.uniform(0, n_channels, background)])
        ch = np.round(ch)
        inside = (ch >= 0) & (ch < n_channels)  # a band that drifts off the channel range falls silent
        t, ch = t[inside], ch[inside].astype(np.int64)
        order = np.argsort(t)
        times.append(t[order])
        units.append(ch[order])
    return SpikeEvents(times, units, labels.astype(np.int64), n_channels)


def bin_events(data: SpikeEvents, index: np.ndarray, n_steps: int, max_time: float) -> np.ndarray:
    """Dense spikes ``(n_steps, len(index), channels)`` in {0, 1}: samples ``index`` binned over ``[0, max_time)``.

    Spikes at or after ``max_time`` are dropped; several spikes of one channel in one bin count once.

    Examples
    --------
    >>> data = SpikeEvents([np.array([0.0, 0.05, 0.6])], [np.array([2, 2, 0])], np.array([1]), 3)
    >>> bin_events(data, np.array([0]), n_steps=2, max_time=1.0)[:, 0]
    array([[0., 0., 1.],
           [1., 0., 0.]], dtype=float32)
    """
    out = np.zeros((n_steps, len(index), data.n_channels), np.float32)
    for b, i in enumerate(index):
        t, u = data.times[i], data.units[i]
        keep = (t >= 0) & (t < max_time)
        steps = (t[keep] / max_time * n_steps).astype(np.int64)
        out[steps, b, u[keep]] = 1.0
    return out
