"""Several training sources mixed by their weights: `--train_file a b --train_weights 0.7 0.3`.

The schedule and the mixed blocks on their own (pure), then runs: the realized token shares over 100 steps,
the summary and the closing line, the same per-step losses on 1 process and FSDP and after a resume mid-run
(2-process DDP: tests/test_matrix.py), prepared and `datasets`-folder sources, and bad input (one line,
exit 2, nothing written)."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from datasets import Dataset

from mlm_ddp import prepare as prep
from mlm_ddp.config import parse_args
from mlm_ddp.data.counts import SourceCounts
from mlm_ddp.data.masking import EPOCH_KEY, MaskingCollator
from mlm_ddp.data.mixture import MixedBlocks, Schedule, Source, apportion
from mlm_ddp.train import main
from tests.conftest import (
    NO_DROPOUT,
    SAME_STEPS,
    BySource,
    corpus_paragraphs,
    read_metrics,
    recorded_batches,
    run_module,
    tiny_args,
    train_losses,
    trained_blocks,
)
from tests.test_fsdp import FSDP_ENV, launch

WEIGHTS = ["0.7", "0.3"]
# dropout off and a constant rate (as test_fsdp's COMMON, which `launch` adds): every topology trains the same steps
STEPS = ["--max_train_steps", "6", "--checkpointing_steps", "3", "--eval_steps", "6", *NO_DROPOUT,
         "--lr_scheduler_type", "constant", "--report", "false"]


@pytest.fixture(scope="module")
def other(corpus: dict) -> Path:
    """A second, smaller source: 40 paragraphs of the documentation that train.txt does not hold."""
    path = corpus["root"] / "mix_other.txt"
    path.write_text("\n".join(corpus_paragraphs()[900:940]) + "\n")
    return path


def mix_args(tiny_model: Path, corpus: dict, out: Path, other: Path, *extra: str) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--train_file", str(corpus["train"]), str(other),
                     "--train_weights", *WEIGHTS, *extra)


def held(by: BySource, steps: list[list[list[int]]], sources: list[dict]) -> dict[str, dict[str, int]]:
    """What the batches of `steps` held of each source (`BySource`: told by the blocks' tokens), checked against
    summary.json's `sources`: the same blocks and tokens, by name."""
    counted = by.count([block for step in steps for block in step])
    assert {s["name"]: {"blocks": s["blocks"], "tokens": s["tokens"]} for s in sources} == counted
    return counted


def at_step_3(run: Path, out: Path) -> Path:
    """A copy of `run` (6 steps, checkpoints at 3 and 6) as it was when its step 3 was saved."""
    shutil.copytree(run, out)
    for later in ("summary.json", "final", "checkpoints/step-0000006"):
        shutil.rmtree(out / later) if (out / later).is_dir() else (out / later).unlink()
    return out


def blocks(lengths: list[int]) -> Dataset:
    return Dataset.from_dict({"input_ids": [[7] * n for n in lengths]})


# --- pure parts --------------------------------------------------------------------------------------------


def test_apportion_gives_whole_slots_in_proportion() -> None:
    assert apportion([0.7, 0.3]) == [7, 3]
    assert apportion([9, 1]) == [9, 1]
    assert apportion([2, 2]) == [1, 1]
    thirds = apportion([1, 1, 1])  # 10,000 slots cannot be split in three: within one slot
    assert sum(thirds) == 10_000 and max(thirds) - min(thirds) == 1
    counts = apportion([0.5, 0.3333, 0.1667])
    assert abs(counts[1] / sum(counts) - 0.3333) < 1e-4
    assert min(apportion([0.99999, 0.00001])) == 1  # a source never gets no slot


def test_the_schedule_keeps_every_prefix_within_one_block_of_its_share() -> None:
    schedule = Schedule.from_counts([5, 3, 2])
    shares = np.array([0.5, 0.3, 0.2])
    for slot in range(0, 300):
        read = schedule.read_before(slot)
        assert read.sum() == slot
        assert np.all(np.abs(read - slot * shares) <= 1.0), (slot, read)
        assert schedule.read_before(slot + 1)[schedule.source_of(slot)] == read[schedule.source_of(slot)] + 1


def test_each_pass_of_a_source_reads_every_block_once_and_is_reshuffled() -> None:
    sources = [Source("a", 0.5, blocks([4] * 10), np.full(10, 4)), Source("b", 0.5, blocks([4] * 3), np.full(3, 4))]
    mixed = MixedBlocks(sources, seed=3)
    located = [mixed.locate(slot) for slot in range(40)]  # a: 20 slots = 2 passes; b: 20 slots, 6+ passes
    passes_a = [[b for s, p, b in located if s == 0 and p == k] for k in (0, 1)]
    assert all(sorted(p) == list(range(10)) for p in passes_a) and passes_a[0] != passes_a[1]
    assert located == [MixedBlocks(sources, seed=3).locate(slot) for slot in range(40)]  # pure
    assert located != [MixedBlocks(sources, seed=4).locate(slot) for slot in range(40)]  # seeded
    rows = mixed.__getitems__([0, 1, 39])
    assert [r[EPOCH_KEY] for r in rows] == [p for _, p, _ in (located[0], located[1], located[39])]
    assert mixed.report(40)[1]["passes"] == pytest.approx(20 / 3, abs=1e-4)


def test_shares_are_of_tokens_when_blocks_differ_in_length() -> None:
    """--line_by_line: lines of unequal length; slots are given in proportion to weight / mean length."""
    rng = np.random.default_rng(0)
    short, long = rng.integers(3, 12, size=97).tolist(), rng.integers(20, 64, size=31).tolist()
    sources = [Source("short", 0.5, blocks(short), np.array(short)), Source("long", 0.5, blocks(long), np.array(long))]
    report = MixedBlocks(sources, seed=0).report(20_000)
    tokens = [r["tokens"] for r in report]
    assert tokens[0] / sum(tokens) == pytest.approx(0.5, abs=0.005)


def serve(mixed: MixedBlocks, counts: list[SourceCounts], first: int, steps: int, batch: int,
          rng: np.random.Generator) -> list[list[int]]:
    """`steps` global micro-batches of slots from `first` on, rank r of len(counts) taking slice r of each, as the
    feed reads them: each rank's batch collated, its tags counted, its step taken; now and then a window read and
    dropped first (a loss spike's, skipped). Returns the blocks the batches held."""
    collate = MaskingCollator(mask_token_id=4, pad_token_id=0, special_ids=[0, 1, 2, 3, 4], vocab_size=600)
    held_blocks = []
    for step in range(steps):
        slot = first + step * batch * len(counts)
        for rank, count in enumerate(counts):
            rows = mixed.__getitems__(list(range(slot + rank * batch, slot + (rank + 1) * batch)))
            if rng.random() < 0.2:  # read, then replaced by the window that trains: never counted
                count.held([collate(mixed.__getitems__(list(range(slot + 10_000, slot + 10_000 + batch))))])
            count.held([collate(rows)])
            count.took()
            held_blocks += [list(row["input_ids"]) for row in rows]
    return held_blocks


@pytest.mark.parametrize("seed", range(8))
def test_the_counts_after_a_change_of_weights_and_processes_are_what_the_batches_held(seed: int) -> None:
    """Generated: 3 sources of blocks of 3-19 tokens whose first token names the source; some steps at one set of
    weights on 1-2 ranks, a checkpoint (the counts of all ranks), then more steps at other weights on 1-4 ranks
    (--allow_source_changes; every other case drops the third source). Each source's blocks, tokens and passes are
    those the batches held and add up to them all, the dropped source kept at weight 0; the new weights' schedule
    from slot 0 would say otherwise."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(5, 40, size=3)
    sources = []
    for s, size in enumerate(sizes):
        lengths = rng.integers(3, 20, size=size)
        ids = [[10 + s] + rng.integers(20, 600, size=n - 1).tolist() for n in lengths]
        sources.append(Source(f"s{s}", 1.0, Dataset.from_dict({"input_ids": ids}), np.asarray(lengths)))
    before, after = rng.dirichlet([1, 1, 1]), rng.dirichlet([1, 1, 1])
    kept = 2 if seed % 2 else 3
    first = MixedBlocks([Source(x.name, w, x.blocks, x.lengths) for x, w in zip(sources, before, strict=True)], seed)
    then = MixedBlocks([Source(x.name, w / after[:kept].sum(), x.blocks, x.lengths)
                        for x, w in zip(sources[:kept], after[:kept], strict=True)], seed)
    global_batch, steps = 4, [int(n) for n in rng.integers(5, 60, size=2)]
    ranks = [int(rng.choice([1, 2])), int(rng.choice([1, 2, 4]))]

    counts = [SourceCounts.of(first) for _ in range(ranks[0])]
    held_blocks = serve(first, counts, 0, steps[0], global_batch // ranks[0], rng)
    saved = counts[0].total(lambda _: [c.mine.ravel().tolist() for c in counts])  # noqa: B023
    counts = [SourceCounts.of(then) for _ in range(ranks[1])]
    for count in counts:
        count.restore(saved)
    held_blocks += serve(then, counts, steps[0] * global_batch, steps[1], global_batch // ranks[1], rng)
    report = counts[0].report(lambda _: [c.mine.ravel().tolist() for c in counts])  # noqa: B023

    truth = {f"s{s}": {"blocks": 0, "tokens": 0} for s in range(3)}
    for block in held_blocks:
        truth[f"s{block[0] - 10}"]["blocks"] += 1
        truth[f"s{block[0] - 10}"]["tokens"] += len(block)
    assert {r["name"]: {"blocks": r["blocks"], "tokens": r["tokens"]} for r in report} == truth
    assert sum(r["tokens"] for r in report) == sum(len(b) for b in held_blocks)
    assert [r["passes"] for r in report] == [round(truth[r["name"]]["blocks"] / len(x.blocks), 4)
                                             for r, x in zip(report, sources, strict=False)]
    assert [r["weight"] for r in report][:kept] == pytest.approx(list(after[:kept] / after[:kept].sum()))
    if kept == 2:
        assert report[2]["name"] == "s2" and report[2]["weight"] == 0.0
    planned = then.report((steps[0] + steps[1]) * global_batch)
    assert [p["blocks"] for p in planned] != [truth[p["name"]]["blocks"] for p in planned]


def test_flags_and_a_yaml_list_give_the_same_sources(tmp_path: Path) -> None:
    flags = parse_args(["--train_file", "d/legal.txt", "g.jsonl", "--train_weights", "0.9", "0.1"]).data
    assert (flags.train_file, flags.train_weights, flags.train_names) == (["d/legal.txt", "g.jsonl"], [0.9, 0.1], None)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"train_file": [{"path": "d/legal.txt", "weight": 0.9, "name": "legal"},
                                                              {"path": "g.jsonl", "weight": 0.1}]}}))
    data = parse_args(["--config", str(recipe)]).data
    assert (data.train_file, data.train_weights, data.train_names) == (["d/legal.txt", "g.jsonl"], [0.9, 0.1],
                                                                       ["legal", "g"])
    again = parse_args(shlex.split(parse_args(["--config", str(recipe)]).command_line())[3:]).data
    assert (again.train_file, again.train_weights, again.train_names) == (data.train_file, data.train_weights,
                                                                          data.train_names)
    assert parse_args(["--train_file", "one.txt"]).data.train_file == ["one.txt"]  # one source: as before


# --- runs -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def by_source(tiny_model: Path, corpus: dict, other: Path) -> BySource:
    from transformers import AutoTokenizer

    return BySource(AutoTokenizer.from_pretrained(tiny_model), {"train": corpus["train"], "mix_other": other}, 32)


@pytest.fixture(scope="module")
def straight_run(tiny_model: Path, corpus: dict, other: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[list[int]]]]:
    """One process, 6 steps of 8 blocks, a checkpoint at step 3; and the blocks of each step."""
    out = tmp_path_factory.mktemp("mixture") / "straight"
    with recorded_batches() as made:
        assert main(mix_args(tiny_model, corpus, out, other, *STEPS)) == 0
    return out, trained_blocks(made)


@pytest.fixture(scope="module")
def straight(straight_run: tuple[Path, list]) -> Path:
    return straight_run[0]


def test_realized_token_shares_match_the_weights_over_100_steps(tiny_model: Path, corpus: dict, other: Path,
                                                                tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                by_source: BySource) -> None:
    """800 blocks: the larger source makes about 0.4 passes, the smaller (40 paragraphs) more than one, reshuffled.
    The shares are those the batches held, each block's source told by its tokens (not the schedule's
    arithmetic, which a block served from the wrong source would not move)."""
    with caplog.at_level("INFO"), recorded_batches() as made:
        assert main(mix_args(tiny_model, corpus, tmp_path / "run", other, "--max_train_steps", "100",
                             "--logging_steps", "50", "--eval_steps", "1000", "--report", "false",
                             "--train_names", "docs", "extra")) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    sources = summary["sources"]
    assert [s["name"] for s in sources] == ["docs", "extra"] and [s["weight"] for s in sources] == [0.7, 0.3]
    counted = by_source.count([block for step in trained_blocks(made) for block in step])
    assert [(s["blocks"], s["tokens"]) for s in sources] == [(c["blocks"], c["tokens"]) for c in counted.values()]
    assert sum(s["blocks"] for s in sources) == 800 and sum(s["tokens"] for s in sources) == summary["tokens_seen"]
    for source, weight in zip(sources, (0.7, 0.3), strict=True):
        assert source["tokens"] / summary["tokens_seen"] == pytest.approx(weight, abs=0.01)
    assert sources[0]["passes"] < 1 < sources[1]["passes"]
    closing = next(line for line in caplog.text.splitlines() if "done: 100 steps" in line)
    assert f"; sources: docs {sources[0]['tokens']} tokens (70.0%" in closing and "passes)" in closing
    start = next(line for line in caplog.text.splitlines() if "a mixture of 2 sources" in line)
    assert "docs 70.0% of the tokens" in start and f"{sources[1]['passes']:.2f} passes in this run" in start
    card = (tmp_path / "run" / "final" / "README.md").read_text()
    assert f"on {corpus['train'].name} (70% of the tokens), {other.name} (30% of the tokens), trained" in card


def test_fsdp_and_a_resume_train_the_same_steps(straight: Path, tiny_model: Path, corpus: dict, other: Path,
                                                tmp_path: Path) -> None:
    """FSDP on 2 processes x 4 (global batch 8), dropout off, fp32: the same blocks, masks and steps as 1 process
    (SAME_STEPS); 2-process DDP is compared in the shared runs of tests/test_matrix.py (its mix-p2 cases)."""
    reference = train_losses(straight)
    assert sorted(reference) == list(range(1, 7))
    out = tmp_path / "fsdp"
    proc = run_module(launch("fsdp.yaml", tiny_model, corpus, out, *STEPS, "--per_device_train_batch_size", "4",
                             "--train_file", str(corpus["train"]), str(other), "--train_weights", *WEIGHTS),
                      env=FSDP_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(out)
    assert sorted(losses) == sorted(reference)
    assert all(losses[s] == pytest.approx(reference[s], rel=SAME_STEPS) for s in reference), losses
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sources"] == json.loads((straight / "summary.json").read_text())["sources"]
    resumed = at_step_3(straight, tmp_path / "resumed")
    assert main(mix_args(tiny_model, corpus, resumed, other, *STEPS, "--resume_from_checkpoint", "latest")) == 0
    losses = train_losses(resumed)
    assert all(losses[s] == pytest.approx(reference[s], rel=SAME_STEPS) for s in range(4, 7)), losses
    assert json.loads((resumed / "summary.json").read_text())["sources"] == \
        json.loads((straight / "summary.json").read_text())["sources"]


def test_a_resume_with_other_weights_is_refused_unless_allowed(straight_run: tuple[Path, list], tiny_model: Path,
                                                                corpus: dict, other: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture,
                                                                caplog: pytest.LogCaptureFixture,
                                                                by_source: BySource) -> None:
    """Allowed, the sources' figures are what the batches held: steps 1-3 at 0.7/0.3, then 4-6 at 0.5/0.5 (issue
    55: they were the new weights' schedule from step 0)."""
    straight, straight_steps = straight_run
    out = at_step_3(straight, tmp_path / "changed")
    before = sorted(p.name for p in out.rglob("*"))
    args = [*tiny_args(tiny_model, corpus, out, *STEPS, "--train_file", str(corpus["train"]), str(other),
                       "--train_weights", "0.5", "0.5", "--resume_from_checkpoint", "latest")]
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "data.train_weights: [0.7, 0.3] -> [0.5, 0.5]" in err[0], err
    assert sorted(p.name for p in out.rglob("*")) == before  # nothing written
    swapped = [a if a != str(other) else str(corpus["valid"]) for a in args]  # another source, the same weights
    swapped[swapped.index("0.5"):swapped.index("0.5") + 2] = WEIGHTS
    assert main(swapped) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "data.train_file" in err[0] and "valid.txt" in err[0], err
    assert sorted(p.name for p in out.rglob("*")) == before
    with caplog.at_level("INFO"), recorded_batches() as made:
        assert main([*args, "--allow_source_changes"]) == 0
    assert "resuming with a changed setting: data.train_weights [0.7, 0.3] -> [0.5, 0.5]" in caplog.text
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["allow_source_changes"] is True
    summary = json.loads((out / "summary.json").read_text())
    assert [s["weight"] for s in summary["sources"]] == [0.5, 0.5]
    resumed = trained_blocks(made)
    assert len(resumed) == 3  # steps 4 to 6
    counted = held(by_source, straight_steps[:3] + resumed, summary["sources"])
    assert sum(c["tokens"] for c in counted.values()) == summary["tokens_seen"]
    # 17 + 7 blocks at 0.7/0.3 (the round-robin's first 24), then 12 + 12: not the 24 + 24 of 0.5/0.5 from step 0
    assert [c["blocks"] for c in counted.values()] == [29, 19]


@pytest.fixture(scope="module")
def prepared(tiny_model: Path, other: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mix_other.txt prepared whole: a source that holds out no text."""
    out = tmp_path_factory.mktemp("mixture") / "prepared"
    assert prep.main(["--model_name_or_path", str(tiny_model), "--train_file", str(other), "--max_seq_length", "32",
                      "--validation_split_percentage", "0", "--output_dir", str(out)]) == 0
    return out


def held_out_share_args(tiny_model: Path, corpus: dict, out: Path, *extra: str) -> list[str]:
    """tiny_args without --validation_file: each source evaluates the share of its text it holds out."""
    args = tiny_args(tiny_model, corpus, out, "--report", "false", *extra)
    drop = args.index("--validation_file")
    return args[:drop] + args[drop + 2:]


def test_a_checkpoint_without_counts_resumes_with_what_earlier_versions_reported(
        straight: Path, tiny_model: Path, corpus: dict, other: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """An earlier version's checkpoint saved no counts: the figures up to it are the schedule's, exact here (the
    mixture did not change), and the log says where they come from."""
    out = at_step_3(straight, tmp_path / "legacy")
    state_file = out / "checkpoints" / "step-0000003" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["sources"]
    state_file.write_text(json.dumps(state))
    with caplog.at_level("INFO"):
        assert main(mix_args(tiny_model, corpus, out, other, *STEPS, "--resume_from_checkpoint", "latest")) == 0
    assert json.loads((out / "summary.json").read_text())["sources"] == \
        json.loads((straight / "summary.json").read_text())["sources"]
    assert ("the checkpoint saved no per-source counts (an earlier version): summary.json's sources up to step 3 "
            "are the schedule's figures") in caplog.text


def test_prepared_and_dataset_folder_sources_mix_with_a_file(tiny_model: Path, corpus: dict, prepared: Path,
                                                             tmp_path: Path) -> None:
    """No --validation_file: each source that holds out a share of its text is evaluated apart, by name; the
    prepared folder holds none."""
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(corpus["valid"], folder / "train.txt")
    out = tmp_path / "out"
    assert main(held_out_share_args(tiny_model, corpus, out, "--max_train_steps", "20", "--eval_steps", "20",
                                    "--train_file", str(corpus["train"]), str(prepared), str(folder),
                                    "--train_weights", "2", "1", "1")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["sources"]] == ["train", "prepared", "folder"]
    shares = [s["tokens"] / summary["tokens_seen"] for s in summary["sources"]]
    assert shares == pytest.approx([0.5, 0.25, 0.25], abs=0.02)  # 160 blocks: one block is 0.6%
    assert set(summary["eval_after"]["sources"]) == {"train", "folder"}


def test_the_one_source_that_holds_text_out_is_evaluated_by_its_name(tiny_model: Path, corpus: dict, prepared: Path,
                                                                     tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Of two sources only train.txt holds a share out: its evaluation is train's, not the mixture's."""
    out = tmp_path / "out"
    with caplog.at_level("INFO"):
        assert main(held_out_share_args(tiny_model, corpus, out, "--max_train_steps", "1", "--train_file",
                                        str(corpus["train"]), str(prepared), "--train_weights", "1", "1")) == 0
    records = [r for r in read_metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in records] == [0, 1] and all(list(r["eval_sources"]) == ["train"] for r in records)
    assert all(r["eval_loss"] == r["eval_sources"]["train"]["loss"] for r in records)  # the mix is that source
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["eval_before"]["sources"]) == list(summary["eval_after"]["sources"]) == ["train"]
    closing = next(line for line in caplog.text.splitlines() if "done: 1 steps" in line)
    assert "; per source: train loss " in closing and " -> " in closing.split("per source: train")[1]


def test_num_train_epochs_counts_passes_over_the_source_of_the_largest_weight(tiny_model: Path, corpus: dict,
                                                                              other: Path, tmp_path: Path) -> None:
    out = tmp_path / "epoch"
    assert main(mix_args(tiny_model, corpus, out, other, "--num_train_epochs", "1", "--report", "false",
                         "--eval_steps", "1000", "--max_train_samples", "60")) == 0  # 60 blocks of each: 11 steps
    summary = json.loads((out / "summary.json").read_text())
    first = summary["sources"][0]
    # one whole pass, and no more than the rest of the last global batch (8 blocks) beyond it
    assert 1.0 <= first["passes"] < 1.0 + 8 / 60 and summary["steps"] == 11


def test_streamed_sources_mix_run_out_and_resume_exactly(tiny_model: Path, corpus: dict, other: Path,
                                                         tmp_path: Path) -> None:
    """--streaming: 4 texts of each source (about 10 blocks), so every source runs out and starts its next
    pass within 6 steps of 8 blocks; a resume from step 3 trains the uninterrupted steps 4 to 6."""
    args = [*STEPS, "--streaming", "--max_train_samples", "4", "--shuffle_buffer_size", "3"]
    straight = tmp_path / "straight"
    assert main(mix_args(tiny_model, corpus, straight, other, *args)) == 0
    summary = json.loads((straight / "summary.json").read_text())
    assert [s["name"] for s in summary["sources"]] == ["train", "mix_other"]
    assert sum(s["tokens"] for s in summary["sources"]) == summary["tokens_seen"]
    assert all(s["passes"] >= 2 for s in summary["sources"]), summary["sources"]
    shares = [s["tokens"] / summary["tokens_seen"] for s in summary["sources"]]
    assert shares == pytest.approx([0.7, 0.3], abs=0.05)  # shares of 48 blocks, a few of them short
    resumed = at_step_3(straight, tmp_path / "resumed")
    assert main(mix_args(tiny_model, corpus, resumed, other, *args, "--resume_from_checkpoint", "latest")) == 0
    reference, losses = train_losses(straight), train_losses(resumed)
    assert all(losses[s] == pytest.approx(reference[s], rel=SAME_STEPS) for s in range(4, 7)), (losses, reference)
    assert json.loads((resumed / "summary.json").read_text())["sources"] == summary["sources"]
    # as an earlier version saved it: no counts in trainer_state.json, this rank's tokens in its stream position
    legacy = at_step_3(straight, tmp_path / "legacy")
    saved = legacy / "checkpoints" / "step-0000003"
    state, position = (json.loads((saved / name).read_text()) for name in ("trainer_state.json", "data_state_0.json"))
    position["tokens"] = [s["tokens"] for s in state.pop("sources")]
    (saved / "trainer_state.json").write_text(json.dumps(state))
    (saved / "data_state_0.json").write_text(json.dumps(position))
    assert main(mix_args(tiny_model, corpus, legacy, other, *args, "--resume_from_checkpoint", "latest")) == 0
    assert json.loads((legacy / "summary.json").read_text())["sources"] == summary["sources"]


@pytest.mark.parametrize("case", ["count", "zero", "negative", "unweighted", "missing", "empty", "blank", "names",
                                  "twice", "stream_lines", "stream_workers"])
def test_bad_sources_are_one_line_and_exit_2_before_anything_is_written(
        case: str, tiny_model: Path, corpus: dict, other: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, empty = tmp_path / "out", tmp_path / "empty.txt"
    empty.write_text("")
    train, extra = [str(corpus["train"]), str(other)], ()
    flags = {"count": ["--train_weights", "1", "2", "3"], "zero": ["--train_weights", "1", "0"],
             "negative": ["--train_weights", "1", "-1"], "unweighted": [],
             "missing": ["--train_weights", "1", "1"], "empty": ["--train_weights", "1", "1"],
             "blank": ["--train_weights", "1", "1"],
             "names": ["--train_weights", "1", "1", "--train_names", "a", "a"],
             "twice": ["--train_weights", "1", "1", "--train_names", "a", "b"],  # named apart, still one file
             "stream_lines": ["--train_weights", "1", "1", "--streaming", "--line_by_line"],
             "stream_workers": ["--train_weights", "1", "1", "--streaming", "--dataloader_num_workers", "2"]}[case]
    if case == "missing":
        train[1] = str(tmp_path / "nope.txt")
    if case == "empty":
        train[1] = str(empty)
    if case == "blank":
        (tmp_path / "blank.txt").write_text("\n\n \n")
        train[1] = str(tmp_path / "blank.txt")
    if case == "twice":
        train[1] = str(corpus["root"] / "." / "train.txt")
    if case.startswith("stream"):
        extra = ("--max_train_steps", "2")
    code = main(tiny_args(tiny_model, corpus, out, *extra, "--train_file", *train, *flags))
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(err) == 1, err
    expected = {"count": "3 weight(s) for 2 --train_file source(s)", "zero": "must be a positive number",
                "negative": "must be a positive number", "unweighted": "give each one's share",
                "missing": "nope.txt: no such file", "empty": "empty.txt: the file is empty",
                "blank": "blank.txt: the file holds only blank lines, no text",
                "names": "two sources are both named 'a'", "twice": "given twice",
                "stream_lines": "--streaming --line_by_line with 2 --train_file sources",
                "stream_workers": "drop --dataloader_num_workers 2"}[case]
    assert expected in err[0]
    assert not out.exists()
