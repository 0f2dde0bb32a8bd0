"""`--torch_compile`: the repeated layer, the last layer on the masked positions and the head compiled
(mlm_ddp/model/compiled.py) compute the eager step, without a graph break, compiling a bounded number
of times as batches change their masked count, their length and their padding; a compiled run on two
processes, killed and resumed, trains the eager one-process curve."""

from __future__ import annotations

from pathlib import Path

import torch

from mlm_ddp.config import ModelConfig
from mlm_ddp.model.loading import wrap_model
from mlm_ddp.model.positions import loss_layout
from tests.conftest import CONFIGS, LAUNCH, NO_DROPOUT, assert_matches_one_process, free_port, run_module, tiny_args
from tests.test_model import IGNORE_INDEX, VOCAB

CPU = torch.device("cpu")


def bert(layers: int = 3, dropout: float = 0.0) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                      hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))


def generated_batch(seed: int) -> dict:
    """A batch as the collator makes it: a length of 16-64 (--line_by_line's), padded or packed, 2-40% of
    the tokens masked, and the loss layout computed on the host."""
    g = torch.Generator().manual_seed(seed)
    length = int(torch.randint(16, 65, (), generator=g))
    padded = bool(torch.randint(0, 2, (), generator=g))
    ids = torch.randint(5, VOCAB, (4, length), generator=g)
    attention_mask = torch.ones(4, length, dtype=torch.long)
    if padded:
        attention_mask[-1, int(torch.randint(2, length, (), generator=g)):] = 0
    share = 0.02 + 0.38 * float(torch.rand((), generator=g))
    labels = torch.where(torch.rand(4, length, generator=g) < share, ids, IGNORE_INDEX)
    labels[0, 1] = ids[0, 1]  # at least one masked token
    labels[attention_mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": attention_mask, "labels": labels, "padded": padded,
            **loss_layout(labels != IGNORE_INDEX)}


def compare_compiled(backend: str, training: list[int], evaluation: list[int]) -> list[int]:
    """The compiled model (`backend`) against the eager one on the generated batches of seeds `training`
    (forward and backward, gradients summed) and then `evaluation` (no_grad): the same losses, gradients and
    counts, and no graph break. Returns dynamo's count of distinct graphs after each training batch."""
    from accelerate.state import PartialState
    from torch._dynamo.utils import counters

    PartialState()  # wrap_model logs through accelerate's logger
    torch._dynamo.reset()
    counters.clear()
    eager = wrap_model(bert(), ModelConfig(), torch_compile=False, device=CPU)
    compiled = wrap_model(bert(), ModelConfig(), torch_compile=True, device=CPU, compile_options={"backend": backend})
    assert compiled.last_layer_subset and eager.last_layer_subset  # the fast path is kept under compile
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints load either way

    graphs = []
    for seed in training:
        b = generated_batch(seed)
        got, want = compiled(**b), eager(**b)
        got[0].backward()
        want[0].backward()
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, msg=f"batch {seed}")
        assert int(got[2]) == 0  # a training step runs no argmax: nothing reads its accuracy
        graphs.append(counters["stats"]["unique_graphs"])
    # summed over the batches' loss sums: fp32's rounding relative to the whole gradient's size (some
    # tensors', the keys' bias, are zero but for rounding: softmax ignores what every key adds alike)
    got = torch.cat([p.grad.flatten() for p in compiled.parameters()])
    want = torch.cat([p.grad.flatten() for p in eager.parameters()])
    assert (got - want).norm() <= 1e-5 * want.norm()
    compiled.eval()
    eager.eval()
    with torch.no_grad():
        for seed in evaluation:
            b = generated_batch(seed)
            got, want = compiled(**b), eager(**b)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            assert int(got[2]) == int(want[2])  # evaluation counts what it predicted right
    assert not counters["graph_break"], dict(counters["graph_break"])
    return graphs


def test_compiled_regions_trace_with_no_graph_break_and_a_bounded_number_of_compilations() -> None:
    """12 training batches and 4 evaluation ones, on aot_eager: dynamo's graphs, their breaks and
    recompilations are the backend's input, the same for Inductor (whose kernels the next test checks)."""
    graphs = compare_compiled("aot_eager", list(range(12)), list(range(100, 104)))
    # At most, per region and kind of mask (the layer's and the subset's: a padded batch's 4-D mask, or none
    # for a packed one; the head's: none), one compilation for the first shapes and one with the changing
    # sizes symbolic: 2 x (2 + 2 + 1) = 10 in training; evaluation (dropout's flag) one more each, its sizes
    # already symbolic: 5. Measured: 8 and 5. And every shape is covered after the first few batches: no
    # compilation in the second half of training.
    assert graphs[5] == graphs[-1], graphs
    assert graphs[-1] <= 15, graphs


def test_inductors_kernels_compute_the_eager_step_and_evaluation() -> None:
    """Inductor's generated kernels on a padded and a packed batch (both kinds of mask) in training, then
    an evaluation batch: each compiled once, at its first shapes."""
    kinds = {seed: generated_batch(seed)["padded"] for seed in range(12)}
    padded, packed = next(s for s, p in kinds.items() if p), next(s for s, p in kinds.items() if not p)
    compare_compiled("inductor", [padded, packed], [padded])


def test_dropout_in_a_compiled_layer_draws_from_the_default_generator_so_a_resume_redraws_it() -> None:
    """A checkpoint saves the default generator's state; a compiled layer's dropout, drawn by Inductor,
    must be a function of it for a resumed run to draw the uninterrupted run's masks."""
    from accelerate.state import PartialState

    PartialState()
    torch._dynamo.reset()
    model = wrap_model(bert(layers=2, dropout=0.1), ModelConfig(), torch_compile=True, device=CPU)
    b = generated_batch(0)
    torch.manual_seed(5)
    model(**b)  # the first step
    state = torch.get_rng_state()
    second = model(**b)[0]
    third = model(**b)[0]
    torch.set_rng_state(state)  # as a resume restores it
    assert torch.equal(model(**b)[0], second) and not torch.equal(second, third)


def test_a_compiled_run_of_two_processes_killed_and_resumed_trains_the_eager_one_process_curve(
        tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """The compiled regions inside DDP, through a kill and a resume. The backend is aot_eager: the same
    dynamo graphs and compiled autograd as Inductor, without generating kernels (Inductor's
    are checked against eager in process, above), so that four processes cost no four Inductor compilations."""
    out, steps = tmp_path / "run", 6
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", str(steps), "--checkpointing_steps", "2",
                     "--per_device_train_batch_size", "8", "--torch_compile", "--torch_compile_backend", "aot_eager",
                     *NO_DROPOUT)
    launch = [*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--num_processes", "2",
              "--num_cpu_threads_per_process", "1"]
    killed = run_module([*launch, "--main_process_port", str(free_port()), "-m", "tests.fault_driver",
                         "--kill", "1:4", *args])
    assert killed.returncode != 0 and (out / "checkpoints" / "step-0000002").is_dir(), killed.stderr[-3000:]
    resumed = run_module([*launch, "--main_process_port", str(free_port()), "-m", "mlm_ddp.train", *args,
                          "--resume_from_checkpoint", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("torch.compile (aot_eager): 1 x BertLayer (one graph, reused), the last layer on the masked "
            "positions, the MLM head (BertOnlyMLMHead)") in resumed.stderr
    assert_matches_one_process(out, tiny_model, corpus, tmp_path / "eager", steps)
