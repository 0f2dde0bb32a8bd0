"""Like with like, and the change with its uncertainty: what makes two probe figures comparable
(`settings`), and after - before of two comparable ones (`change`).

A probe's figure is a measurement with an error (DESIGN.md, pitfall 20): the test set is a sample of the
texts the task will see, and a subsample of the training texts is one draw of many. So a change is
reported paired (the same subsamples, seeds and test texts for both models, which removes what the two
share) with a 95% interval from a paired bootstrap: the test texts are drawn again with replacement, and
where there are several seeds the seeds too, and the change is recomputed on each draw.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from mlm_ddp.probe.config import ProbeConfig

RESAMPLES = 1000  # bootstrap draws of the change's interval
BOOTSTRAP_SEED = 0  # the draws are seeded: the same figures give the same interval


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


def weighted_scores(labels: np.ndarray, predicted: np.ndarray, weights: np.ndarray, n_classes: int) -> np.ndarray:
    """[accuracy, macro-F1] of `predicted` (N,) against `labels` (N,) on a resample that holds text i weights[i]
    times: scikit-learn's accuracy_score and f1_score(average="macro", zero_division=0) of the resampled texts
    (tests/test_probe.py checks it against them). From one weighted confusion matrix, because a thousand
    resamples x seeds x two models of scikit-learn's calls, a few ms each, would take minutes."""
    confusion = np.bincount(labels * n_classes + predicted, weights=weights,
                            minlength=n_classes * n_classes).reshape(n_classes, n_classes)  # (true, predicted)
    hits, true, said = np.diag(confusion), confusion.sum(axis=1), confusion.sum(axis=0)
    present = true + said > 0  # f1_score averages over the labels in y_true or y_pred, no others
    f1 = np.divide(2 * hits, true + said, out=np.zeros(n_classes), where=present)
    return np.array([hits.sum() / confusion.sum(), f1[present].mean()])


def change(before: dict[str, Any], after: dict[str, Any], labels: np.ndarray, resamples: int = RESAMPLES,
           seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """after - before of accuracy and macro-F1 (means over seeds), with 95% percentile intervals from a paired
    bootstrap over the test texts and, where there are several, the seeds. Both figures must have been made
    with the same settings (ValueError otherwise): their predictions_per_seed (S, N) pair seed by seed and
    text by text."""
    if before.get("settings") != after.get("settings"):
        changed = differences(before.get("settings"), after.get("settings"))
        raise ValueError(f"the two figures were made with other settings ({changed})")
    old, new = np.asarray(before["predictions_per_seed"]), np.asarray(after["predictions_per_seed"])  # (S, N)
    labels = np.asarray(labels)
    if old.shape != new.shape or old.shape[1] != len(labels):
        raise ValueError(f"predictions of shapes {old.shape} and {new.shape} on {len(labels)} test texts do not pair")
    seeds, n = new.shape
    n_classes = int(max(labels.max(), old.max(), new.max())) + 1
    rng = np.random.default_rng(seed)
    drawn = np.zeros((resamples, 2))  # each draw's change of [accuracy, macro-F1]
    for r in range(resamples):
        weights = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)  # (N,): times each text is drawn
        chosen = rng.integers(0, seeds, seeds)  # the seeds drawn (with one seed: that one)
        per_seed = np.array([weighted_scores(labels, new[s], weights, n_classes)
                             - weighted_scores(labels, old[s], weights, n_classes) for s in range(seeds)])  # (S, 2)
        drawn[r] = per_seed[chosen].mean(axis=0)
    low, high = np.percentile(drawn, [2.5, 97.5], axis=0)
    out: dict[str, Any] = {}
    for k, key in enumerate(("accuracy", "macro_f1")):
        out[key] = after[key] - before[key]
        out[f"{key}_ci95"] = [float(low[k]), float(high[k])]
    return out | {"resamples": resamples, "seeds": seeds, "n_test": n}


def measurable(interval: list[float]) -> bool:
    """False where the 95% interval holds 0: no change the probe can tell from its noise."""
    return not interval[0] <= 0 <= interval[1]


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
