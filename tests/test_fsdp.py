"""FSDP for real: accelerate_configs/fsdp.yaml on two CPU processes over gloo (accelerate alone would
run DDP there). The same curve as DDP for BERT and RoBERTa, with a trained MLM head and with one
initialised fresh (a checkpoint without a head, as all-MiniLM-L6-v2); sharded checkpoints that resume
exactly after a stop signal, refusals of what cannot be resumed, a kill -9 during a sharded save, a
final/ that is the whole tied model; bf16 on DDP and FSDP against fp32. The
uninterrupted runs share two launches, one per config (the `runs` fixture); a run stopped, killed or slowed
on purpose has a launch of its own."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mlm_ddp.config import parse_args
from mlm_ddp.errors import EXIT_REQUEUE, BadInput
from mlm_ddp.loop import checkpoint as ckpt
from mlm_ddp.run import run_folder
from mlm_ddp.train import main
from tests.conftest import (
    CONFIGS,
    LAUNCH,
    NO_DROPOUT,
    REPO,
    SAME_STEPS,
    free_port,
    last_step,
    launch_runs,
    read_metrics,
    run_module,
    tiny_args,
    tiny_family_model,
    train_losses,
    wait_for,
)
from tests.test_reliability import popen, workers_of
from tests.test_topology import max_rel_diff

STEPS = 20
# constant learning rate: the first N steps of any run are the same whatever --max_train_steps says,
# so a run stopped by a signal and resumed can be compared with one straight run
COMMON = [*NO_DROPOUT, "--lr_scheduler_type", "constant", "--mixed_precision", "no", "--report", "false"]
FSDP_ENV = {"ACCELERATE_USE_CPU": "true"}


def launch(config: str, model: Path, corpus: dict, out: Path, *extra: str,
           module: tuple[str, ...] = ("mlm_ddp.train",)) -> list[str]:
    """`accelerate launch` of 2 processes running `module` (with its own leading flags)."""
    return [*LAUNCH, "--config_file", str(CONFIGS / config), "--num_processes", "2", "--main_process_port",
            str(free_port()), "-m", *module, *tiny_args(model, corpus, out, *COMMON, *extra)]


def train_two(config: str, model: Path, corpus: dict, out: Path, *extra: str) -> str:
    proc = run_module(launch(config, model, corpus, out, *extra), env=FSDP_ENV if config == "fsdp.yaml" else None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.fixture(scope="module")
def tiny_roberta(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer RobertaForMaskedLM with the tiny BERT's tokenizer."""
    return tiny_family_model("roberta", tiny_model, tmp_path_factory.mktemp("tiny_roberta"))


@pytest.fixture(scope="module")
def tiny_roberta_fresh(tiny_roberta: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny RoBERTa's encoder saved as a RobertaModel: its MLM head is initialised fresh on loading."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    root = tmp_path_factory.mktemp("tiny_roberta_fresh")
    AutoModelForMaskedLM.from_pretrained(tiny_roberta).roberta.save_pretrained(root)
    AutoTokenizer.from_pretrained(tiny_roberta).save_pretrained(root)
    return root


# the data paths users take, each trained by FSDP2 and by DDP
DATA_PATHS = [
    # a stream read by both ranks, two micro-batches a step, whole words masked
    ("--streaming", "--shuffle_buffer_size", "8", "--max_eval_samples", "16", "--gradient_accumulation_steps", "2",
     "--whole_word_mask"),
    # one line per sequence, padded per batch, three micro-batches a step (which do not divide the epoch); an
    # optimizer that steps on the host's decision (not fused: the gradient norm is read as a plain tensor)
    ("--line_by_line", "--gradient_accumulation_steps", "3", "--per_device_train_batch_size", "4",
     "--optimizer_impl", "foreach"),
]
DROPOUT = ["--config_overrides", "hidden_dropout_prob=0.1,attention_probs_dropout_prob=0.1"]
BF16_STEPS = 10


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tiny_fresh_head: Path, tiny_roberta_fresh: Path, corpus: dict,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    """config ("fsdp.yaml", "cpu_ddp.yaml") -> run id -> the run's result (tests/matrix_driver): every
    uninterrupted run of this file, each config's under one `accelerate launch` of 2 processes
    (tests.conftest.launch_runs). FSDP: the tiny BERT (trained head) and its encoder (fresh head) for 20
    steps with sharded checkpoints every 4; the fresh-head RoBERTa; the data paths; gradient checkpointing;
    bf16; dropout, straight and resumed from its step 4 into another folder. DDP: the curves FSDP must
    train."""
    root = tmp_path_factory.mktemp("fsdp_runs")
    models = {"bert-trained": tiny_model, "bert-fresh": tiny_fresh_head, "roberta-fresh": tiny_roberta_fresh}
    straight = ["--max_train_steps", str(STEPS)]
    sharded = [*straight, "--checkpointing_steps", "4", "--save_total_limit", "2"]
    paths = {f"path-{i}": (tiny_fresh_head, ["--max_train_steps", "6", *v]) for i, v in enumerate(DATA_PATHS)}
    bf16 = (tiny_fresh_head, ["--max_train_steps", str(BF16_STEPS), "--checkpointing_steps", str(BF16_STEPS),
                              "--mixed_precision", "bf16"])
    dropout = root / "fsdp.yaml" / "dropout-straight"
    plans = {
        "fsdp.yaml": {
            "bert-trained": (tiny_model, sharded),
            "bert-fresh": (tiny_fresh_head, sharded),
            "roberta-fresh": (tiny_roberta_fresh, straight),
            **paths,
            "checkpointed": (tiny_fresh_head, ["--max_train_steps", "6", "--gradient_checkpointing"]),
            "bf16": bf16,
            "dropout-straight": (tiny_fresh_head, ["--max_train_steps", "8", "--checkpointing_steps", "4", *DROPOUT]),
            "dropout-resumed": (tiny_fresh_head, ["--max_train_steps", "8", "--resume_from_checkpoint",
                                                  str(dropout / "checkpoints" / "step-0000004"), *DROPOUT]),
        },
        "cpu_ddp.yaml": {
            **{name: (model, straight) for name, model in models.items()},
            **paths,
            "bf16": bf16,
        },
    }
    done = {}
    for config, plan in plans.items():
        cases = [{"id": name, "out": str(root / config / name),
                  "argv": tiny_args(model, corpus, root / config / name, *COMMON, *extra)}
                 for name, (model, extra) in plan.items()]
        done[config] = launch_runs(cases, root / f"results-{config}", config=config,
                                   env=FSDP_ENV if config == "fsdp.yaml" else None)
        for name, result in done[config].items():
            assert result["exit"] == 0, (config, name, result["log"][-3000:])
            # each run of the FSDP launch shards: the plugin holds for a run after another in one process
            assert ("DistributedType.FSDP" in result["log"]) == (config == "fsdp.yaml"), (config, name)
    return done


def finished(runs: dict, name: str, config: str = "fsdp.yaml") -> tuple[Path, str]:
    """(output_dir, log) of one of the shared runs."""
    return Path(runs[config][name]["out"]), runs[config][name]["log"]


@pytest.fixture(scope="module")
def bert_fsdp(runs: dict) -> tuple[Path, str]:
    return finished(runs, "bert-trained")


@pytest.fixture(scope="module")
def fresh_fsdp(runs: dict) -> tuple[Path, str]:
    """The same, from a checkpoint without an MLM head: ranks > 0 load the fresh head on the meta device, where
    the optimizer's state dict would fail at the first save unless mlm_ddp gives those weights real tensors
    (docs/topologies.md)."""
    return finished(runs, "bert-fresh")


@pytest.mark.parametrize(("family", "head"), [("bert", "trained"), ("bert", "fresh"), ("roberta", "fresh")])
def test_fsdp_trains_the_ddp_curve(family: str, head: str, runs: dict) -> None:
    """fp32, dropout off, global batch 16 both ways: FSDP and DDP sum the same gradients in another order
    (reduce-scatter of shards against all-reduce of buckets), which moves fp32 sums by a few ulps (1e-7
    relative); 1e-5 over 20 steps leaves room for that to compound, and not for one parameter trained
    otherwise (the fresh head's split at the first update was 1e-2). RoBERTa with its trained head is not
    run: its units and tie are the fresh case's (the same RobertaForMaskedLM, whose head is made by loading),
    and a trained head's loading is BERT's case."""
    layer = {"bert": "BertLayer", "roberta": "RobertaLayer"}[family]
    fsdp, log = finished(runs, f"{family}-{head}")
    assert ("has no trained MLM head" in log) == (head == "fresh")
    assert "mlm_ddp keeps its FSDP2 plugin (gloo)" in log
    assert "topology: 2 process(es) on 1 node(s), DistributedType.FSDP" in log
    # the wrap class comes from the model; the embeddings, tied to the head, stay in the root unit with it
    assert f"FSDP units: each {layer} (taken from the model)" in log
    assert "Embeddings, which holds a parameter tied to the MLM head" in log
    ddp, _ = finished(runs, f"{family}-{head}", "cpu_ddp.yaml")
    a, b = train_losses(ddp), train_losses(fsdp)
    assert sorted(b) == list(range(1, STEPS + 1))
    worst = max_rel_diff(a, b)
    print(f"{family}, {head} head: FSDP vs DDP, largest relative loss difference over {STEPS} steps: {worst:.2e}")
    assert worst <= SAME_STEPS, (a, b)


def test_sharded_checkpoints_are_complete_rotated_and_refused_where_they_cannot_resume(
        bert_fsdp: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = bert_fsdp
    done = ckpt.complete_checkpoints(out)
    assert [p.name for p in done] == ["step-0000016", "step-0000020"]  # --save_total_limit 2
    newest = done[-1]
    for name in ckpt.state_files(2, sharded=True):
        assert (newest / name).is_file(), name
    # what rank 1 fsyncs itself before the main process marks the checkpoint complete
    mine = sorted(str(p.relative_to(newest)) for p in newest.rglob("*") if p.is_file() and ckpt.written_by_rank(p, 1))
    assert mine == ["optimizer_0/__1_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp", "random_states_1.pkl"]
    assert not (newest / "model.safetensors").exists()
    saved = yaml.safe_load((newest / "config.yaml").read_text())
    state, _ = run_folder.check_resume(newest, saved, world_size=2, sharded=True)
    assert state.step == STEPS and state.world_size == 2
    with pytest.raises(BadInput, match="written by 2 process"):
        run_folder.check_resume(newest, saved, world_size=4, sharded=True)
    with pytest.raises(BadInput, match="written by an FSDP run .* does not shard the model"):
        run_folder.check_resume(newest, saved, world_size=2, sharded=False)
    damaged = shutil.copytree(newest, tmp_path / "damaged")
    (damaged / "optimizer_0" / "__1_0.distcp").unlink()
    with pytest.raises(BadInput, match=r"missing optimizer_0/__1_0.distcp"):
        run_folder.check_resume(damaged, saved, world_size=2, sharded=True)
    # torch unpickles DCP metadata without restriction: a pickle that would run code is refused first
    hostile = shutil.copytree(newest, tmp_path / "hostile")
    (hostile / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(BadInput, match="posix.system is not part of checkpoint metadata"):
        run_folder.check_resume(hostile, saved, world_size=2, sharded=True)


def test_a_stop_signal_saves_a_sharded_checkpoint_and_latest_resumes_the_straight_curve(
        fresh_fsdp: tuple[Path, str], tiny_fresh_head: Path, corpus: dict, tmp_path: Path) -> None:
    # a fresh head: its first save used to fail on rank 1 (KeyError in the optimizer's state dict)
    straight = train_losses(fresh_fsdp[0])
    out = tmp_path / "stopped"
    proc = popen(launch("fsdp.yaml", tiny_fresh_head, corpus, out, "--max_train_steps", "400"), env=FSDP_ENV)
    try:
        wait_for(lambda: last_step(out) >= 2, 120, "step 2")
        ranks = workers_of(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGUSR1)  # one rank only: both save the same sharded checkpoint
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "exitcode  : 75" in output, output[-3000:]
    record = json.loads((out / "stopped.json").read_text())
    assert record["exit_code"] == EXIT_REQUEUE and 2 <= record["step"] < STEPS - 4
    saved = Path(record["checkpoint"])
    assert (saved / ckpt.MARKER).exists() and (saved / "pytorch_model_fsdp_0" / "__1_0.distcp").exists()

    train_two("fsdp.yaml", tiny_fresh_head, corpus, out, "--max_train_steps", str(STEPS), "--resume_from_checkpoint",
              "latest")
    resumed = train_losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max_rel_diff(straight, resumed) <= SAME_STEPS
    assert not (out / "stopped.json").exists()
    assert [p.name for p in ckpt.complete_checkpoints(fresh_fsdp[0])] == ["step-0000016", "step-0000020"]


def test_final_is_the_whole_tied_model_and_evaluates_as_the_last_eval(
        bert_fsdp: tuple[Path, str], tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM, pipeline

    out, _ = bert_fsdp
    final = out / "final"
    weights = load_file(str(final / "model.safetensors"))
    embeddings = weights["bert.embeddings.word_embeddings.weight"]
    assert tuple(embeddings.shape) == (600, 32)  # whole, not a shard
    decoder = weights.get("cls.predictions.decoder.weight")
    assert decoder is None or decoder.equal(embeddings)  # saved once (tied), or as the same values
    model = AutoModelForMaskedLM.from_pretrained(final)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    fill = pipeline("fill-mask", model=str(final), device="cpu")
    assert len(fill("the [MASK] of the function", top_k=3)) == 3

    last_eval = [r for r in read_metrics(out) if "eval_loss" in r][-1]
    assert last_eval["step"] == STEPS
    # final/ evaluated by a fresh one-process run (its step-0 eval) on the same held-out set
    check = tmp_path / "check"
    assert main(tiny_args(final, corpus, check, "--max_train_steps", "1", *COMMON)) == 0
    first_eval = [r for r in read_metrics(check) if "eval_loss" in r][0]
    assert first_eval["step"] == 0
    assert first_eval["eval_loss"] == pytest.approx(last_eval["eval_loss"], rel=SAME_STEPS)


@pytest.mark.parametrize("path", range(len(DATA_PATHS)))
def test_fsdp_trains_the_ddp_curve_on_the_data_paths_users_take(path: int, runs: dict) -> None:
    losses, norms = {}, {}
    for config in ("cpu_ddp.yaml", "fsdp.yaml"):
        out, _ = finished(runs, f"path-{path}", config)
        losses[config] = train_losses(out)
        norms[config] = {r["step"]: r["grad_norm"] for r in read_metrics(out) if "loss" in r}
    assert sorted(losses["fsdp.yaml"]) == list(range(1, 7))
    assert max_rel_diff(losses["cpu_ddp.yaml"], losses["fsdp.yaml"]) <= SAME_STEPS
    # the logged norm is the whole model's under FSDP2 too, not one rank's shard of it
    assert max_rel_diff(norms["cpu_ddp.yaml"], norms["fsdp.yaml"]) <= SAME_STEPS


def test_fsdp_with_dropout_resumes_into_another_folder_with_the_same_losses(runs: dict, fresh_fsdp: tuple[Path, str]
                                                                          ) -> None:
    """Dropout on: the resumed run draws the masks the straight one drew, from every rank's restored RNG."""
    a, b = (train_losses(finished(runs, name)[0]) for name in ("dropout-straight", "dropout-resumed"))
    assert sorted(b) == [5, 6, 7, 8]
    assert max(abs(a[s] - b[s]) / a[s] for s in b) <= SAME_STEPS
    # dropout was on: the same steps without it (fresh_fsdp) have other losses
    no_dropout = train_losses(fresh_fsdp[0])
    assert max(abs(a[s] - no_dropout[s]) / no_dropout[s] for s in a) > 100 * SAME_STEPS


def test_gradient_checkpointing_under_fsdp_trains_the_same_curve(runs: dict, fresh_fsdp: tuple[Path, str]) -> None:
    """Dropout off: recomputing each layer in the backward gives the same gradients, and the last layer
    runs on every position (the subset path is off), which changes only the summation order."""
    out, log = finished(runs, "checkpointed")
    assert "--gradient_checkpointing recomputes the layer's full forward" in log
    straight, checkpointed = train_losses(fresh_fsdp[0]), train_losses(out)
    assert sorted(checkpointed) == list(range(1, 7))
    assert max(abs(checkpointed[s] - straight[s]) / straight[s] for s in checkpointed) <= SAME_STEPS


BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significant bits


@pytest.mark.parametrize("config", ["cpu_ddp.yaml", "fsdp.yaml"])
def test_bf16_trains_within_bf16_rounding_of_fp32(config: str, runs: dict, fresh_fsdp: tuple[Path, str]) -> None:
    """bf16 on two CPU processes (native on AVX512-BF16/AMX, emulated elsewhere: the same roundings).

    The bound: each logit carries bf16's relative rounding (at most 2^-8 of it), and the loss is a mean of
    log-softmaxes of those logits, accumulated in fp32; its error cannot exceed one bf16 rounding of the
    loss unless every token's error had the same sign. The master weights stay fp32, so 10 updates at
    lr 1e-3 from gradients of that accuracy move the curve by far less (measured: about 2e-4 relative).
    The runs must differ, too: equal losses would mean bf16 never ran."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    fp32 = train_losses(fresh_fsdp[0])
    out, log = finished(runs, "bf16", config)
    steps = BF16_STEPS
    assert "precision bf16 (--mixed_precision bf16)" in log
    bf16 = train_losses(out)
    assert sorted(bf16) == list(range(1, steps + 1))
    worst = max(abs(bf16[s] - fp32[s]) / fp32[s] for s in bf16)
    print(f"{config}: bf16 vs fp32, largest relative loss difference over {steps} steps: {worst:.2e}")
    assert 0 < worst <= BF16_UNIT_ROUNDOFF
    # master weights, optimizer state and final/ stay fp32
    assert {t.dtype for t in load_file(str(out / "final" / "model.safetensors")).values()} == {torch.float32}
    saved = out / "checkpoints" / f"step-{steps:07d}"
    if config == "fsdp.yaml":
        for folder in ckpt.SHARDED_DIRS:
            metadata = FileSystemReader(str(saved / folder)).read_metadata().state_dict_metadata
            dtypes = {m.properties.dtype for m in metadata.values() if hasattr(m, "properties")}
            assert dtypes == {torch.float32}, (folder, dtypes)
    else:
        state = torch.load(saved / "optimizer.bin", weights_only=True)["state"]
        assert {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}
        assert {t.dtype for t in load_file(str(saved / "model.safetensors")).values()} == {torch.float32}


SLOW_SAVES = [(60, True), (3, False)]  # (--save_timeout, whether the run finishes)


@pytest.fixture(scope="module")
def slow_saves(tiny_fresh_head: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """--save_timeout -> the exit, log and output folder of its run in the test below; both at once (they
    mostly wait on rank 1's injected 8 s)."""
    root = tmp_path_factory.mktemp("slow_saves")
    runs = {}
    for save_timeout, finishes in SLOW_SAVES:
        out, log = root / str(save_timeout) / "run", root / f"{save_timeout}.log"
        final = ["--slow_state_dict", "1:8"] if finishes else []
        args = launch("fsdp.yaml", tiny_fresh_head, corpus, out, "--max_train_steps", "2", "--checkpointing_steps",
                      "2", "--ddp_timeout", "3", "--save_timeout", str(save_timeout),
                      module=("tests.fault_driver", "--slow_shard_write", "1:8", *final))
        with log.open("w") as sink:  # a file, not a pipe: neither run blocks on output nobody reads yet
            proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **FSDP_ENV})
        runs[save_timeout] = {"proc": proc, "out": out, "log": log}
    try:
        for run in runs.values():
            run["code"] = run["proc"].wait(timeout=300)
    finally:
        for run in runs.values():
            if run["proc"].poll() is None:
                run["proc"].kill()
                run["proc"].wait()
    return {t: {"code": r["code"], "out": r["out"], "log": r["log"].read_text()} for t, r in runs.items()}


@pytest.mark.parametrize(("save_timeout", "finishes"), SLOW_SAVES)
def test_a_slow_shard_write_and_a_slow_final_gather_wait_for_save_timeout_not_ddp_timeout(
        save_timeout: int, finishes: bool, slow_saves: dict[int, dict]) -> None:
    """Rank 1 writes its shards 8 s late; rank 0 waits in the sharded save's collectives on the training
    group, whose --ddp_timeout is 3 s. With --save_timeout 60 the save waits (without mlm_ddp's
    patient_collectives it fails after 3 s, tried by hand); --save_timeout 3 still bounds it. The run that
    finishes also has rank 1 gather final/'s state dict 8 s late: final/'s FSDP gather runs on the training
    group and waits --save_timeout as a save does (at --ddp_timeout this run would fail 3 s into its final
    phase); one run checks both, a launch fewer than a run of its own."""
    run = slow_saves[save_timeout]
    out = run["out"]
    assert (run["code"] == 0) == finishes, run["log"][-3000:]
    assert (out / "checkpoints" / "step-0000002" / ckpt.MARKER).exists() == finishes
    assert (out / "final" / "model.safetensors").exists() == finishes


def test_kill_9_during_a_sharded_save_leaves_nothing_latest_would_pick(tiny_model: Path, corpus: dict,
                                                                     tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = popen(launch("fsdp.yaml", tiny_model, corpus, out, "--max_train_steps", "8", "--checkpointing_steps", "2",
                        module=("tests.fault_driver", "--slow_save_s", "3")), env=FSDP_ENV)
    half = out / "checkpoints" / ".tmp-step-0000004" / ckpt.STATE_FILE  # every shard written, no marker yet
    workers: dict[int, int] = {}
    try:
        wait_for(half.exists, 120, "the save of step 4")
        workers = workers_of(proc.pid)
    finally:
        for pid in workers.values():  # SIGKILL: no handler, no cleanup, on every rank
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()
    assert sorted(workers) == [0, 1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [".tmp-step-0000004", "step-0000002"]
    assert (out / "checkpoints" / ".tmp-step-0000004" / "pytorch_model_fsdp_0" / "__1_0.distcp").exists()
    assert run_folder.resolve_resume("latest", out).name == "step-0000002"
    assert ckpt.partial_checkpoints(out)[0].name == ".tmp-step-0000004"
    cfg = parse_args(tiny_args(tiny_model, corpus, out, *COMMON, "--max_train_steps", "8",
                               "--checkpointing_steps", "2"))
    state, _ = run_folder.check_resume(out / "checkpoints" / "step-0000002", cfg.to_dict(), world_size=2, sharded=True)
    assert state.step == 2



def _tiny(family: str):
    import transformers as T

    small = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=64, pad_token_id=0)
    configs = {
        "bert": T.BertConfig(**small), "roberta": T.RobertaConfig(**small), "electra": T.ElectraConfig(**small),
        "deberta-v2": T.DebertaV2Config(**small),
        "distilbert": T.DistilBertConfig(vocab_size=120, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                         max_position_embeddings=64, pad_token_id=0),
        "modernbert": T.ModernBertConfig(**small, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
    }
    return T.AutoModelForMaskedLM.from_config(configs[family])


@pytest.mark.parametrize(("family", "wrap", "held"), [
    ("bert", ["BertLayer"], ["BertEmbeddings"]),
    ("roberta", ["RobertaLayer"], ["RobertaEmbeddings"]),
    ("modernbert", ["ModernBertEncoderLayer"], ["ModernBertEmbeddings"]),
    ("distilbert", ["TransformerBlock"], []),  # no _no_split_modules: the repeated layers
    ("electra", ["ElectraLayer"], []),
    ("deberta-v2", ["DebertaV2Layer"], []),
])
def test_fsdp_units_come_from_the_model_and_never_split_a_tie(family: str, wrap: list, held: list) -> None:
    from mlm_ddp.model.loading import fsdp_wrap_classes, tied_parameters

    model = _tiny(family)
    ties = tied_parameters(model)
    assert any(any(n.endswith("word_embeddings.weight") or n.endswith("tok_embeddings.weight") for n in g)
               for g in ties), ties  # the decoder shares the word embeddings
    assert fsdp_wrap_classes(model, None) == (wrap, held)
    # every tie lies inside one unit: in no wrapped module, or wholly inside one
    wrapped = [(p, m) for p, m in model.named_modules() if type(m).__name__ in wrap]
    for group in map(set, ties):
        for path, module in wrapped:
            mine = {f"{path}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)}
            assert not group & mine or group <= mine


def test_fsdp_wrap_classes_overrides_and_names_a_class_the_model_lacks() -> None:
    from mlm_ddp.model.loading import fsdp_wrap_classes

    model = _tiny("bert")
    assert fsdp_wrap_classes(model, "BertLayer,BertEmbeddings") == (["BertLayer"], ["BertEmbeddings"])
    with pytest.raises(BadInput, match="has no module of class 'RobertaLayer'; its layers are BertLayer"):
        fsdp_wrap_classes(model, "RobertaLayer")
