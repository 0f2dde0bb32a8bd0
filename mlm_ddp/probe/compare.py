"""Like with like, and the change with its uncertainty: what makes two probe figures comparable
(`settings`), and after - before of two comparable ones (`change`).

A probe's figure is a measurement with an error (docs/design.md, pitfall 20): the test set is a sample of the
texts the task will see, and each seed (a subsample of the training texts, a fine-tune's draws) is one draw
of many. So a change is reported paired (the same subsamples, seeds and test texts for both models, which
removes what the two share) with a 95% interval for the change's expectation over both: new test texts from
the same source, and new seeds. The interval is Student's t on the per-seed, per-text differences, with a
variance from the two-way layout (texts x seeds): the seeds' spread of their changes, plus what the test texts
shared by every seed add. docs/probe.md says what it covers and its measured coverage; tests/test_probe_interval.py
measures it on simulated datasets.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from mlm_ddp.probe.config import ProbeConfig

LEVEL = 0.95  # the change's interval


def file_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def settings(cfg: ProbeConfig) -> dict[str, Any]:
    """What made a figure: two figures compare only where these are equal. The files by their contents' hash;
    a dataset by its name, configuration and split."""
    keys = ["mode", "protocol", "max_train_per_label", "seeds", "text_column", "label_column", "pooling",
            "max_seq_length"] + (["learning_rate", "epochs", "batch_size"] if cfg.mode == "finetune" else [])
    out: dict[str, Any] = {key: getattr(cfg, key) for key in keys}
    for split in ("train", "test"):
        if cfg.dataset_name is not None:
            name = cfg.train_split if split == "train" else cfg.test_split
            out[split] = " ".join(str(part) for part in ("dataset", cfg.dataset_name, cfg.dataset_config_name, name)
                                  if part is not None)
        else:
            path = cfg.train_file if split == "train" else cfg.test_file
            out[split] = file_hash(path) if path is not None else None
    return out


def differences(earlier: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """'max_train_per_label 8 -> 0, test sha256:ab.. -> sha256:cd..' ('' where the settings are equal)."""
    earlier = earlier or {}
    return ", ".join(f"{key} {earlier.get(key)} -> {now.get(key)}" for key in sorted(set(earlier) | set(now))
                     if earlier.get(key) != now.get(key))


def text_shares(labels: np.ndarray, predicted: np.ndarray, n_classes: int) -> np.ndarray:
    """(2, S, N): text i's share of seed s's [accuracy, macro-F1], whose mean over the N texts is the seed's figure
    (scikit-learn's accuracy_score and f1_score(average="macro", zero_division=0)) of `predicted` (S, N) against
    `labels` (N,). Accuracy's share is whether the text is right. Macro-F1 is no mean over texts, so its share is
    the figure plus the text's linearised influence on it (the delta method: F1_k = 2 TP_k / (T_k + P_k), each a
    mean over texts), which the interval then treats as accuracy's."""
    seeds, n = predicted.shape
    right = predicted == labels  # (S, N)
    flat = (predicted + n_classes * np.arange(seeds)[:, None]).ravel()  # class numbers, one block of K per seed
    said = np.bincount(flat, minlength=seeds * n_classes).reshape(seeds, n_classes) / n  # (S, K): P_k
    hit = np.bincount(flat[right.ravel()], minlength=seeds * n_classes).reshape(seeds, n_classes) / n  # TP_k
    both = np.bincount(labels, minlength=n_classes) / n + said  # (S, K): T_k + P_k
    present = both > 0  # f1_score averages over the labels in y_true or y_pred, no others
    scale = np.where(present, both, 1.0)
    f1 = 2 * hit / scale  # (S, K), 0 where absent
    n_present = present.sum(axis=1, keepdims=True)  # (S, 1)
    macro = (f1 * present).sum(axis=1, keepdims=True) / n_present  # (S, 1)
    rows = np.arange(seeds)[:, None]
    # d F1_k for text i: (2 [right, of class k] - F1_k ([of class k] + [said k])) / (T_k + P_k), summed over the
    # classes it touches: (2 - 2 F1_y) / (T + P)_y where it is right; else -F1_y / (T + P)_y - F1_said / (T + P)_said
    influence = (2 * right - f1[rows, labels]) / scale[rows, labels] - f1[rows, predicted] / scale[rows, predicted]
    return np.stack([right.astype(float), macro + influence / n_present])


def interval(paired: np.ndarray, level: float = LEVEL) -> list[float]:
    """[low, high] for the mean of `paired` (S, N: seed s's after - before share of text i), a t interval
    for its expectation over new texts and new seeds.

    The two-way layout: difference = the change + a text's effect + a seed's effect + the rest. The mean's variance
    is B + A. B, the spread of the S per-seed changes over S, carries the seeds' effects and the rest; it is
    estimated on S - 1 degrees of freedom, and with 3 seeds that is the interval's weak point: t's quantile with 2
    degrees of freedom is 4.30, not 1.96. A is what the N texts that every seed shares add (their effects hold
    the same for every seed, so B cannot see them): from the texts' and the rest's mean squares, on ~N degrees
    of freedom, so as good as known. The degrees of freedom are (S - 1) (A + B) / B: S - 1 where the seeds
    dominate, many where the texts do. Welch-Satterthwaite's (S - 1) ((A + B) / B)^2 covers 92% at 3 seeds when
    A is a tenth of B (B, read small, raises them exactly when it should not); these cover 94.4-96.3% whatever
    the ratio at 3 seeds and 95.0-95.6% at 10 (normal errors; docs/probe.md has the coverage measured on
    simulated probes). One seed (S = 1): the texts' spread only, on N - 1 degrees of freedom; what another seed would
    change is not in it. Clipped to [-1, 1], where every change of a share lies."""
    from scipy.special import stdtrit  # Student's t quantile; scipy comes with scikit-learn, which the probe needs

    seeds, n = paired.shape
    mean = float(paired.mean())
    if n < 2:
        return [-1.0, 1.0]  # one text: no spread to read, any change is possible
    if seeds == 1:
        variance, freedom = float(paired.var(ddof=1)) / n, n - 1.0
    else:
        per_text, per_seed = paired.mean(axis=0), paired.mean(axis=1)  # (N,), (S,)
        texts = seeds * float(((per_text - mean) ** 2).sum()) / (n - 1)  # E = rest + S var(text)
        rest = float(((paired - per_text - per_seed[:, None] + mean) ** 2).sum()) / ((n - 1) * (seeds - 1))
        between_seeds = float(per_seed.var(ddof=1)) / seeds
        shared_texts = max(0.0, (texts - rest) / (n * seeds))
        variance = between_seeds + shared_texts
        freedom = (seeds - 1) * variance / between_seeds if between_seeds > 0 else np.inf
    if variance <= 0:
        return [mean, mean]  # every text and seed changed alike: nothing varies
    half = float(stdtrit(freedom, 0.5 + level / 2)) * variance**0.5
    return [max(-1.0, mean - half), min(1.0, mean + half)]


def change(before: dict[str, Any], after: dict[str, Any], labels: np.ndarray) -> dict[str, Any]:
    """after - before of accuracy and macro-F1 (means over seeds), each with its 95% interval (`interval`) over the
    test texts and, where there are several, the seeds. Both figures must have been made with the same settings
    (ValueError otherwise): their predictions_per_seed (S, N) pair seed by seed and text by text."""
    if before.get("settings") != after.get("settings"):
        changed = differences(before.get("settings"), after.get("settings"))
        raise ValueError(f"the two figures were made with other settings ({changed})")
    old, new = np.asarray(before["predictions_per_seed"]), np.asarray(after["predictions_per_seed"])  # (S, N)
    labels = np.asarray(labels)
    if old.shape != new.shape or old.shape[1] != len(labels):
        raise ValueError(f"predictions of shapes {old.shape} and {new.shape} on {len(labels)} test texts do not pair")
    seeds, n = new.shape
    n_classes = int(max(labels.max(), old.max(), new.max())) + 1
    shares = text_shares(labels, new, n_classes) - text_shares(labels, old, n_classes)  # (2, S, N)
    out: dict[str, Any] = {}
    for k, key in enumerate(("accuracy", "macro_f1")):
        out[key] = after[key] - before[key]
        out[f"{key}_ci95"] = interval(shares[k])
    return out | {"seeds": seeds, "n_test": n}


def measurable(bounds: list[float]) -> bool:
    """False where the 95% interval holds 0: no change the probe can tell from its noise."""
    return not bounds[0] <= 0 <= bounds[1]


def describe_change(delta: dict[str, Any]) -> str:
    """'accuracy +0.0050 (95% CI -0.0040..+0.0140), macro-F1 +0.0061 (95% CI -0.0030..+0.0150): no measurable
    change'."""
    parts = [f"{name} {delta[key]:+.4f} (95% CI {delta[key + '_ci95'][0]:+.4f}..{delta[key + '_ci95'][1]:+.4f})"
             for key, name in (("accuracy", "accuracy"), ("macro_f1", "macro-F1"))]
    seen = [measurable(delta[key + "_ci95"]) for key in ("accuracy", "macro_f1")]
    verdict = ("no measurable change" if not any(seen) else
               "a measurable change" if all(seen) else
               f"a measurable change of {'accuracy' if seen[0] else 'macro-F1'} only")
    return ", ".join(parts) + f": {verdict}"
