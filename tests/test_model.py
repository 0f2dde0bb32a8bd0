"""The masked-only MLM head computes the loss and gradients of the full head; a checkpoint saved in bf16
or fp16 trains fp32 master weights; a padded batch's 4-D mask gives the 2-D mask's loss and gradients
exactly, and each family gets the mask it takes without a read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForMaskedLM, DistilBertConfig, DistilBertForMaskedLM

from mlm_ddp.data.masking import IGNORE_INDEX
from mlm_ddp.model import fast_paths
from mlm_ddp.model import loading as model_module
from mlm_ddp.model.loading import MaskedLMLoss, model_mask, padding_mask_4d
from tests.conftest import SAME_STEPS, tiny_args, train_losses

VOCAB = 500


def batch(seed: int, shape: tuple[int, int] = (4, 24)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, shape, generator=g)
    attention_mask = torch.ones(shape, dtype=torch.long)
    attention_mask[-1, shape[1] // 2:] = 0  # one short block, padded
    labels = torch.where(torch.rand(shape, generator=g) < 0.15, input_ids, IGNORE_INDEX)
    labels[attention_mask == 0] = IGNORE_INDEX
    labels[0, 1] = input_ids[0, 1]  # at least one masked token
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def tiny(kind: str) -> torch.nn.Module:
    """A 2-layer masked LM of `kind` (a transformers model type), seeded. ModernBERT's second layer is a
    sliding-window one, its window (8) under the batch's length, so that its mask differs from the first's."""
    torch.manual_seed(0)
    size = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    if kind == "distilbert":
        return DistilBertForMaskedLM(DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64))
    extra = {"roberta": dict(max_position_embeddings=80, pad_token_id=1),
             "modernbert": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                local_attention=8, attention_dropout=0.1)}.get(kind, dict(max_position_embeddings=64))
    return AutoModelForMaskedLM.from_config(AutoConfig.for_model(kind, **size, **extra))


def reference_loss(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' own MLM loss (mean over masked tokens, full head), as a sum."""
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
    return out.loss * (b["labels"] != IGNORE_INDEX).sum()


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_masked_only_head_gives_the_full_head_loss_and_gradients(kind: str) -> None:
    model = tiny(kind).eval()  # no dropout: the two paths must see the same computation
    masked, full = MaskedLMLoss(model, masked_only=True), MaskedLMLoss(model, masked_only=False)
    assert masked.masked_only and not full.masked_only
    b = batch(1)
    grads = {}
    for name, net in (("masked", masked), ("full", full), ("reference", None)):
        model.zero_grad()
        loss_sum = reference_loss(model, b) if net is None else net(**b)[0]
        loss_sum.backward()
        grads[name] = (loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss_m, g_m), (loss_f, g_f), (loss_r, _) = grads["masked"], grads["full"], grads["reference"]
    assert abs(loss_m - loss_f) <= 1e-5 * abs(loss_f) and abs(loss_f - loss_r) <= 1e-5 * abs(loss_r)
    assert g_m.keys() == g_f.keys()
    # fp32 sums in another order: equal up to rounding, measured against the largest gradient (a
    # key bias has a true gradient of 0 and rounding noise of 1e-11 on both paths)
    scale = max(float(g.abs().max()) for g in g_f.values())
    for n in g_m:
        torch.testing.assert_close(g_m[n], g_f[n], rtol=1e-5, atol=1e-6 * scale, msg=n)
    # the counts: masked tokens and right predictions agree too
    assert [int(x) for x in masked(**b)[1:]] == [int(x) for x in full(**b)[1:]]
    assert int(masked(**b)[1]) == int((b["labels"] != IGNORE_INDEX).sum())


def built_masks(model: torch.nn.Module, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """What transformers' builders make of a padded 2-D mask inside the model's forward, per layer type."""
    from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask

    builders = {"full_attention": create_bidirectional_mask,
                "sliding_attention": create_bidirectional_sliding_window_mask}
    embeds = torch.zeros(*attention_mask.shape, 8, device=attention_mask.device)
    return {kind: builders[kind](config=model.config, inputs_embeds=embeds, attention_mask=attention_mask)
            for kind in set(getattr(model.config, "layer_types", None) or ["full_attention"])}


def padded_loss_with_both_masks(kind: str, attention: str, subset: bool, device: str = "cpu") -> tuple:
    """((loss sums, gradients) with the 4-D mask, the same with the 2-D mask) of a padded batch, in training
    mode with the same seeded dropout draws; checks on the way that padding_mask_4d is the mask transformers'
    builders make of the 2-D one (values, shape, layout, per layer type), which a 4-D mask replaces."""
    from tests.test_fast_paths import loss_and_grads

    model = tiny(kind).train().to(device)
    if attention == fast_paths.ATTENTION_DROPOUT16:
        fast_paths.use_dropout16(model)
    net = MaskedLMLoss(model, last_layer_subset=subset and fast_paths.subset_unsupported(model) is None)
    b = {k: v.to(device) for k, v in batch(2, (4, 24)).items()}  # its last row padded
    built = built_masks(model, b["attention_mask"])
    made = padding_mask_4d(model, b["attention_mask"])
    made = made if isinstance(made, dict) else {"full_attention": made}
    assert made.keys() == built.keys()
    for kind_of_layer, mask in made.items():
        assert mask.dtype == torch.bool and mask.shape == built[kind_of_layer].shape == (4, 1, 24, 24)
        assert torch.equal(mask, built[kind_of_layer]) and mask.stride() == built[kind_of_layer].stride()
        assert not mask[-1, 0, 0, -1]
    torch.manual_seed(7)
    with_4d = loss_and_grads(net, b)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_module, "padding_mask_4d", lambda model, attention_mask: attention_mask)  # the 2-D path
        torch.manual_seed(7)
        with_2d = loss_and_grads(net, b)
    return with_4d, with_2d


def assert_same_bits(with_4d: tuple, with_2d: tuple) -> None:
    assert torch.equal(with_4d[0], with_2d[0]), (with_4d[0], with_2d[0])
    assert with_4d[1].keys() == with_2d[1].keys()
    assert all(torch.equal(with_4d[1][name], with_2d[1][name]) for name in with_4d[1])


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert", "modernbert"])
@pytest.mark.parametrize("attention", ["sdpa", "sdpa_dropout16"])
@pytest.mark.parametrize("subset", [False, True])
def test_a_padded_batch_gets_the_4d_mask_and_exactly_the_2d_masks_loss(kind: str, attention: str,
                                                                        subset: bool) -> None:
    """transformers passes a 4-D mask through, so padding_mask_4d must be the mask its builder makes of the
    2-D one: then sdpa gets the same tensor, and the loss and gradients are the same bits, not merely close."""
    assert_same_bits(*padded_loss_with_both_masks(kind, attention, subset))


@pytest.mark.parametrize(("kind", "attention"), [("bert", "sdpa"), ("bert", "eager"), ("electra", "sdpa"),
                                                ("albert", "sdpa"), ("modernbert", "sdpa"), ("modernbert", "eager"),
                                                ("deberta-v2", "eager")])
def test_each_model_gets_the_mask_its_forward_takes_unread(kind: str, attention: str) -> None:
    """sdpa: the 4-D mask of a padded batch (ModernBERT: one per layer type), none when nothing is padded.
    Eager attention adds a float mask in the dtype of the embeddings' output: the 2-D mask, built inside.
    DeBERTa (its own attention, no sdpa) looks for padding in the ids when it gets no mask: the 2-D mask."""
    model = tiny(kind)
    model.set_attn_implementation(attention)
    net = MaskedLMLoss(model)
    mask = torch.ones(2, 8, dtype=torch.long)
    padded = mask.clone()
    padded[1, 5:] = 0
    got, unpadded = (model_mask(model, m, p, net.looks_for_padding) for m, p in ((padded, True), (mask, False)))
    assert net.looks_for_padding is (kind == "deberta-v2")
    if kind == "deberta-v2":
        assert got is padded and unpadded is mask
    elif attention == "eager":
        assert got is padded and unpadded is None
    elif kind == "modernbert":
        assert set(got) == {"full_attention", "sliding_attention"} and unpadded is None
    else:
        assert got.shape == (2, 1, 8, 8) and unpadded is None


def test_a_mask_of_ones_for_a_model_that_looks_for_padding_changes_nothing() -> None:
    """DeBERTa given the 2-D mask of an unpadded batch: the same loss and gradients, bit for bit, as given none."""
    from tests.test_fast_paths import loss_and_grads

    net = MaskedLMLoss(tiny("deberta-v2").train())
    b = {**batch(4), "padded": False}
    b["attention_mask"] = torch.ones_like(b["attention_mask"])
    torch.manual_seed(7)
    with_ones = loss_and_grads(net, b)
    net.looks_for_padding = False  # the mask left out, as for the other encoders
    torch.manual_seed(7)
    assert_same_bits(with_ones, loss_and_grads(net, b))


def test_masked_only_head_never_builds_the_full_logits() -> None:
    # what makes it fast: the decoder sees (N, H), never (B, T, H)
    model = tiny("bert").eval()
    seen = []
    model.cls.predictions.decoder.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    b = batch(2)
    MaskedLMLoss(model)(**b)
    assert seen == [(int((b["labels"] != IGNORE_INDEX).sum()), 32)]


def test_a_model_without_a_single_head_module_falls_back_to_the_full_head() -> None:
    model = tiny("distilbert").eval()
    wrapped = MaskedLMLoss(model, masked_only=True)
    assert not wrapped.masked_only
    b = batch(3)
    assert torch.allclose(wrapped(**b)[0], reference_loss(model, b), rtol=1e-5)


def test_a_batch_without_masked_tokens_adds_zero_and_still_reaches_every_parameter() -> None:
    # DDP (find_unused_parameters=False) needs every parameter in the graph even when a rank's
    # micro-batch has nothing to predict
    model = tiny("bert").eval()
    b = batch(4)
    b["labels"][:] = IGNORE_INDEX
    loss_sum, n, correct = MaskedLMLoss(model)(**b)
    assert float(loss_sum.detach()) == 0.0 and int(n) == 0 and int(correct) == 0
    loss_sum.backward()
    assert all(p.grad is not None for p in model.parameters())


def optimizer_after_two_steps(impl: str) -> dict[str, torch.Tensor]:
    from mlm_ddp.config import from_dict
    from mlm_ddp.loop.optim import build_optimizer

    model = MaskedLMLoss(tiny("bert").eval())
    optimizer = build_optimizer(model, from_dict({"optimizer_impl": impl, "weight_decay": 0.01}).training)
    for seed in (5, 6):
        model(**batch(seed))[0].backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_every_adamw_implementation_makes_the_same_update() -> None:
    reference = optimizer_after_two_steps("for-loop")
    for impl in ("fused", "foreach"):
        for name, value in optimizer_after_two_steps(impl).items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=f"{impl}: {name}")


@pytest.mark.parametrize(("kind", "fresh", "head_lr", "expected_head_lr"), [
    ("bert", True, None, 1e-3), ("bert", False, None, None), ("bert", False, 5e-4, 5e-4),
    ("roberta", True, None, 1e-3),
    ("distilbert", True, 2e-4, 2e-4),  # no single head module, but its head parameters are found all the same
])
def test_a_fresh_head_trains_faster_but_never_the_tied_embeddings(kind: str, fresh: bool, head_lr: float | None,
                                                                   expected_head_lr: float | None) -> None:
    from accelerate.state import PartialState

    from mlm_ddp.config import from_dict
    from mlm_ddp.loop.optim import build_optimizer, head_parameters
    from mlm_ddp.model.loading import FRESH_HEAD

    PartialState()  # accelerate's logger, which the warning goes through, needs one
    model = MaskedLMLoss(tiny(kind))
    if fresh:
        setattr(model.model, FRESH_HEAD, True)  # as load_model marks a checkpoint without a head
    optimizer = build_optimizer(model, from_dict({"learning_rate": 1e-4, "head_learning_rate": head_lr}).training)
    lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    assert len(lr_of) == len(list(model.parameters()))  # every parameter in exactly one group
    head = {id(p) for p in head_parameters(model.model)}
    embeddings = model.model.get_input_embeddings().weight
    assert lr_of[id(embeddings)] == 1e-4  # the decoder is these embeddings: pretrained, base rate
    for name, p in model.named_parameters():
        in_head = id(p) in head and p is not embeddings
        assert lr_of[id(p)] == (expected_head_lr or 1e-4 if in_head else 1e-4), name
    assert len(optimizer.param_groups) == (4 if expected_head_lr else 2)


# --- fp32 master weights from any checkpoint ----------------------------------------------------------


def saved_in(tiny_model: Path, dtype: torch.dtype, stored: torch.dtype, root: Path) -> Path:
    """The tiny BERT with its weights rounded to `dtype` (so that they hold the same values in either
    file), saved in `stored`, with its tokenizer: what a checkpoint published in bf16 or fp16 is."""
    from transformers import AutoTokenizer, BertForMaskedLM

    model = BertForMaskedLM.from_pretrained(tiny_model)
    model.to(dtype).to(stored).save_pretrained(root)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def trained_from(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """(rounded to, stored in) -> the output folder of 6 steps trained from that checkpoint."""
    from mlm_ddp.config import parse_args
    from mlm_ddp.train import train

    runs = {}
    for rounded in (torch.bfloat16, torch.float16):
        for stored in (rounded, torch.float32):
            root = tmp_path_factory.mktemp(f"{rounded}-in-{stored}".replace("torch.", ""))
            checkpoint = saved_in(tiny_model, rounded, stored, root / "checkpoint")
            train(parse_args(tiny_args(checkpoint, corpus, root / "run", "--max_train_steps", "6",
                                       "--report", "false")))
            runs[rounded, stored] = root / "run"
    return runs


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_precision_checkpoint_trains_as_the_same_weights_in_fp32(half: torch.dtype, trained_from: dict) -> None:
    """The same values loaded from a half-precision file and from an fp32 one are the same fp32 parameters:
    the same steps on the same data then give the same losses (SAME_STEPS: what may differ is the order of
    sums, and here nothing does). Trained as half-precision parameters instead, the curves leave fp32's by
1.1e-4 relative (bf16) and 7 (fp16: the loss blows up at step 4)."""
    from safetensors import safe_open

    half_run, fp32_run = trained_from[half, half], trained_from[half, torch.float32]
    a, b = train_losses(fp32_run), train_losses(half_run)
    assert sorted(b) == list(range(1, 7))
    worst = max(abs(a[s] - b[s]) / a[s] for s in a)
    print(f"{half} checkpoint vs the same weights in fp32: largest relative loss difference over 6 steps {worst:.1e}")
    assert worst <= SAME_STEPS, (a, b)
    for run in (half_run, fp32_run):
        with safe_open(run / "final" / "model.safetensors", "pt") as weights:
            assert {weights.get_slice(k).get_dtype() for k in weights.keys()} == {"F32"}
    name = str(half).removeprefix("torch.")
    assert f"| weights | float32 (the source checkpoint's config says {name}) |" in \
        (half_run / "final" / "README.md").read_text()
    assert json.loads((half_run / "final" / "config.json").read_text())["dtype"] == "float32"
