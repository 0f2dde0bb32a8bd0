"""Host-device syncs in the hot loop: counted on the CPU, where nothing syncs, by the
operations that would sync on a CUDA device. A torch dispatch mode sees every aten call of the training
loop (`train.fit`, forward and backward included): scalar reads (`.item()`, `int()`, `bool()`:
aten._local_scalar_dense, is_nonzero), data-dependent shapes (nonzero, masked_select, indexing or
index_put with a boolean mask); `.tolist()`, which a dispatch mode does not see on a CPU, is counted by
a TorchFunctionMode. What the loader does is left out, and only that: torch's DataLoader (its sampler, its
base seed, the collate function it calls) and the masking collator (data/masking.py, with model/positions.py
under it), found anywhere on the stack. On a GPU run that work is done on host tensors (in numpy, or in
DataLoader workers) before the batch is copied to the device, so a scalar read there waits for nothing.
Everything else is counted, data/ included: `data.rank.to_device`, the copy onto the device, and the feed's
own code outside the loader's iteration: leaving every frame under data/ out would leave to_device out
with it. The heartbeat says which step each count belongs to.

The budget: exactly one wait for the device per optimizer step on the steps that neither log, evaluate
nor save (the all-reduce of the step's masked tokens and stop votes, read once). Tensors made on the device
from Python data (`torch.tensor(n, device=...)`) are copies from pageable host memory that wait for the
device, which a dispatch mode cannot see: a TorchFunctionMode counts them, and the budget includes them.
At accumulation 2 that is 1 sync and 0 copies: neither the loss sums' count (per micro-batch) nor the
stop votes (per step) is a copy of Python data. A padded micro-batch (a packed run's short block, every
batch of --line_by_line) costs nothing more: transformers' mask builder, which would read
`padding_mask.all()` back, does not run; the quiet steps of `padded_counted` hold padded micro-batches, and the count
records which (`count_syncs`' "padded"), so that the test cannot pass without them.
The GPU suite (tests/gpu) checks the same with torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import mlm_ddp.train
from mlm_ddp.config import parse_args
from tests.conftest import tiny_args

SCALAR_READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"}
DATA_DEPENDENT = {"aten.nonzero.default", "aten.masked_select.default"}
BOOLEAN_INDEXED = ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default",
                   "aten._index_put_impl_.default")
SYNC_BUDGET = 1


# frames (filename substrings) of the loader's host work: torch's DataLoader and the masking collator (called by
# the DataLoader in training, directly by the bench); a wait is theirs where any frame of its stack is one of these
HOST_SIDE = ("/torch/utils/data/", "/mlm_ddp/data/masking.py")


def host_side(stack: traceback.StackSummary) -> bool:
    """Whether `stack` passes through the loader's host work (HOST_SIDE)."""
    return any(part in frame.filename for frame in stack for part in HOST_SIDE)


def place(stack: traceback.StackSummary) -> str:
    """The innermost mlm_ddp line of `stack`, as its path under mlm_ddp/ (data/rank.py:12)."""
    frames = [f for f in stack if "/mlm_ddp/" in f.filename]
    return f"{frames[-1].filename.rsplit('/mlm_ddp/', 1)[1]}:{frames[-1].lineno}" if frames else "?"


class CountSyncs(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        syncs = name in SCALAR_READS or name in DATA_DEPENDENT or (
            name in BOOLEAN_INDEXED and any(i is not None and i.dtype == torch.bool for i in args[1]))
        if syncs and not host_side(stack := traceback.extract_stack()):
            self.seen.append(f"{name.removeprefix('aten.')} {place(stack)}")
        return func(*args, **(kwargs or {}))


class CountCopies(TorchFunctionMode):
    """Tensors made from Python data (torch.tensor, as_tensor, new_tensor of a list or a number) outside the
    host side, into `copies`: on a GPU each is a copy from pageable host memory that waits for the device
    (docs/design.md, pitfall 15), which the dispatch mode cannot see. And `.tolist()`, into `syncs`: a dispatch
    mode does not see it on a CPU."""

    FROM_DATA = (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor)

    def __init__(self, copies: list[str], syncs: list[str]) -> None:
        super().__init__()
        self.copies, self.syncs = copies, syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        data = args[1] if func is torch.Tensor.new_tensor else args[0] if args else None
        copy = func in self.FROM_DATA and not isinstance(data, torch.Tensor)
        if (copy or func is torch.Tensor.tolist) and not host_side(stack := traceback.extract_stack()):
            (self.copies if copy else self.syncs).append(f"{'tolist' if not copy else func.__name__} {place(stack)}")
        return func(*args, **(kwargs or {}))


STEPS = 8
ACCUMULATION = 2  # micro-batches per optimizer step in the counted runs


def record_padded(patch: pytest.MonkeyPatch, record: Callable[[], None]) -> None:
    """`record()` at each forward of a batch with padding (the collator's `padded`), while `patch` holds."""
    from mlm_ddp.model.loading import MaskedLMLoss

    forward = MaskedLMLoss.forward

    def recorded_forward(self, *args, padded: bool = True, **kwargs):
        if padded:
            record()
        return forward(self, *args, padded=padded, **kwargs)

    patch.setattr(MaskedLMLoss, "forward", recorded_forward)


def count_syncs(args: list[str]) -> dict[str, list[tuple[tuple[int, str], str]]]:
    """One `train` run of `args` with every sync and every copy of Python data counted, each with the
    heartbeat's (step, phase) at the time: {"syncs": [((step, phase), what), ...], "copies": [...],
    "padded": [((step, phase), "padded"), ...], one per micro-batch or evaluation batch with padding}."""
    from mlm_ddp.train import Hooks

    beat_now: list[tuple[int, str]] = [(0, "start")]
    seen: dict[str, list] = {"syncs": [], "copies": [], "padded": []}

    class Stamped(list):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.kind = kind

        def append(self, what: str) -> None:
            seen[self.kind].append((beat_now[-1], what))

    syncs, copies = Stamped("syncs"), Stamped("copies")
    fit = mlm_ddp.train.fit

    def counted_fit(*args, **kwargs):
        with CountSyncs(syncs), CountCopies(copies, syncs):
            return fit(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mlm_ddp.train, "fit", counted_fit)
        record_padded(patch, lambda: seen["padded"].append((beat_now[-1], "padded")))
        mlm_ddp.train.train(parse_args(args), Hooks(on_beat=lambda beat: beat_now.append((beat.step, beat.phase))))
    return seen


def per_step(entries: list[tuple[tuple[int, str], str]], steps: int = STEPS) -> dict[int, list[str]]:
    """Steps 2 .. steps-1 (neither the first, after the evaluation before training, nor the last, which
    logs, evaluates and saves) -> what was counted in it."""
    return {step: [what for (at, _), what in entries if at == step] for step in range(2, steps)}


def waits(counted: dict, steps: int = STEPS) -> dict[int, list[str]]:
    """Per quiet step, what would wait for a GPU: the syncs and the copies of Python data together."""
    syncs, copies = per_step(counted["syncs"], steps), per_step(counted["copies"], steps)
    return {step: syncs[step] + [f"copy: {what}" for what in copies[step]] for step in syncs}


def describe(steps: dict[int, list[str]]) -> str:
    return "; ".join(f"step {s}: {len(v)} ({', '.join(sorted(set(v)))})" for s, v in steps.items())


def test_no_step_and_no_evaluation_batch_copies_python_data_to_the_device(padded_counted: dict) -> None:
    """Neither the loss sums' count, once per micro-batch and per evaluation batch (model.loss_sums), nor
    the stop votes, once per step (step.agree_on_step), is a copy of Python data. Counted in each padded run
    (their steps hold unpadded micro-batches too, and they evaluate the corpus' held-out text)."""
    steps = per_step(padded_counted["copies"])
    evaluation = [what for (_, phase), what in padded_counted["copies"] if phase == "eval"]
    print(f"copies of Python data: per step {[len(v) for v in steps.values()]}, in the evaluations {len(evaluation)}")
    assert all(not v for v in steps.values()), steps
    assert not evaluation, evaluation
    # the mode does see them: a copy made in the step counts
    seen: list[str] = []
    with CountCopies(seen, []):
        torch.tensor(3, device="cpu")
    assert len(seen) == 1


def test_the_loaders_host_work_is_left_out_and_nothing_else() -> None:
    """A scalar read inside a DataLoader's collate function is host work (HOST_SIDE) and is left out; the same
    read after the loader, on the batch it gave, counts."""
    seen: list[str] = []
    with CountSyncs(seen):
        loader = torch.utils.data.DataLoader([1, 2], batch_size=2, collate_fn=lambda b: torch.tensor(b).sum().item())
        assert list(loader) == [3] and seen == [], seen
        torch.tensor([1, 2]).sum().item()
    assert len(seen) == 1, seen


def short_text(root: Path, paragraphs: int = 4) -> Path:
    """The first `paragraphs` of the corpus: a packed epoch of fewer blocks than one optimizer step reads
    (batch 8, accumulation 2), so that every step reads the short block of the epoch, padded."""
    from tests.conftest import corpus_paragraphs

    root.mkdir(parents=True, exist_ok=True)
    (root / "short.txt").write_text("\n".join(corpus_paragraphs()[:paragraphs]) + "\n")
    return root / "short.txt"


PADDED_RUNS = {
    # one tokenization batch whose remainder is a short block, in every step
    "packed, a short block": lambda root: ["--train_file", str(short_text(root))],
    # one line per sequence, each batch padded to its longest line
    "--line_by_line": lambda root: ["--line_by_line", "--max_seq_length", "64"],
}


@pytest.fixture(scope="module", params=list(PADDED_RUNS))
def padded_counted(request: pytest.FixtureRequest, tiny_model: Path, corpus: dict,
                   tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Runs like `counted` whose quiet steps hold padded micro-batches (PADDED_RUNS), counted."""
    root = tmp_path_factory.mktemp("padded")
    counted = count_syncs(tiny_args(tiny_model, corpus, root / "run", "--max_train_steps", str(STEPS),
                                    "--gradient_accumulation_steps", str(ACCUMULATION), "--logging_steps", "1000",
                                    "--report", "false", *PADDED_RUNS[request.param](root)))
    return {**counted, "run": request.param}


def test_a_padded_micro_batch_costs_no_wait_for_the_device(padded_counted: dict) -> None:
    """Exactly the budget, neither 0 (the modes saw nothing) nor more: the read of the step's all-reduce, with
    padding in every quiet step: sdpa gets the 4-D mask (model.padding_mask_4d), so transformers' mask builder,
    which reads `padding_mask.all()` back, never runs: it would cost one more per padded micro-batch (2 or 3
    per step here). The packed run's steps read unpadded blocks beside the short one: the hot loop's budget
    without padding is this count too (a run of the whole corpus, counted apart, was the same check again)."""
    padded = per_step(padded_counted["padded"])
    steps = waits(padded_counted)
    print(f"padded micro-batches per quiet step {[len(v) for v in padded.values()]}; syncs and copies of Python "
          f"data per optimizer step (accumulation 2): {describe(steps)}")
    assert all(padded.values()), f"a quiet step without a padded micro-batch proves nothing: {padded}"
    if padded_counted["run"].startswith("packed"):  # and one with an unpadded micro-batch: the plain hot loop
        assert any(len(v) < ACCUMULATION for v in padded.values()), f"no unpadded micro-batch counted: {padded}"
    assert any(what.startswith("tolist loop/step.py") for what in steps[2]), "nothing counted: the modes saw no step"
    assert all(len(v) == SYNC_BUDGET for v in steps.values()), describe(steps)


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert", "electra", "albert", "modernbert", "deberta-v2"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_no_family_reads_its_attention_mask_back(kind: str, padded: bool) -> None:
    """A forward and backward of each family's masked LM (sdpa; DeBERTa has its own attention) waits for
    nothing, with padding or without (loading.model_mask). Before: ModernBERT 2 waits per padded batch
    (transformers builds a full and a sliding-window mask from the 2-D one, each reading
    `padding_mask.all()`), DeBERTa-v2 1 per unpadded batch (given no mask, transformers looks for padding
    in the first and last ids). The 2-D mask of a padded BERT batch is counted, so the mode sees the read."""
    from mlm_ddp.data.masking import IGNORE_INDEX
    from mlm_ddp.model.loading import MaskedLMLoss
    from mlm_ddp.model.positions import loss_layout
    from tests.test_model import batch, tiny

    net = MaskedLMLoss(tiny(kind).train())
    b = batch(3)
    if not padded:
        b["attention_mask"] = torch.ones_like(b["attention_mask"])
    b.update(loss_layout(b["labels"] != IGNORE_INDEX))  # as the collator gives them: found on the host
    seen: list[str] = []
    with CountSyncs(seen):
        net(**b, padded=padded)[0].backward()
    assert seen == [], seen
    if kind == "bert" and padded:
        with CountSyncs(seen), pytest.MonkeyPatch.context() as patch:
            patch.setattr("mlm_ddp.model.loading.padding_mask_4d", lambda model, attention_mask: attention_mask)
            net(**b, padded=True)[0].backward()
        assert len(seen) == 1, seen


def test_fsdp2_waits_for_the_device_once_per_optimizer_step_too(tiny_model: Path, corpus: dict,
                                                                tmp_path: Path) -> None:
    """FSDP2 on two CPU processes: fused AdamW skips a non-finite update on the device with DTensor parameters
    too (its norm, a replicated DTensor, read as a plain tensor). Before: the norm's finiteness was read back
    before every update, a second wait per step."""
    import json

    from tests.conftest import run_module
    from tests.test_fsdp import FSDP_ENV, launch

    counts = tmp_path / "waits"
    proc = run_module(launch("fsdp.yaml", tiny_model, corpus, tmp_path / "run", "--max_train_steps", str(STEPS),
                             "--gradient_accumulation_steps", "2", "--logging_steps", "1000",
                             module=("tests.sync_driver", str(counts))), env=FSDP_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        steps = {int(step): v for step, v in json.loads((counts / f"waits-{rank}.json").read_text()).items()}
        print(f"FSDP2 rank {rank}: {describe(steps)}")
        assert any(what.startswith("tolist loop/step.py") for what in steps[2]), "nothing counted"
        assert all(len(v) == SYNC_BUDGET for v in steps.values()), describe(steps)


def test_a_logging_step_reads_its_sums_and_gradient_norm_back_once(tiny_model: Path, corpus: dict,
                                                                     tmp_path: Path) -> None:
    """Every step logs (--logging_steps 1): the record's sums and the step's gradient norm come back to the host
    in one read, the logged sums' all-reduce, beside the step's own budget."""
    counted = count_syncs(tiny_args(tiny_model, corpus, tmp_path / "run", "--max_train_steps", str(STEPS),
                                    "--logging_steps", "1", "--report", "false"))
    logged = {step: [what for (at, phase), what in counted["syncs"] if at == step and phase == "log"]
              for step in range(2, STEPS)}
    assert all(len(v) == 1 and v[0].startswith("tolist run/run_log.py") for v in logged.values()), logged
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("grad_norm" in r for r in records if "loss" in r)
