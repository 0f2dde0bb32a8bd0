"""The fast paths (model/fast_paths.py) compute the same objective: the last layer on the masked positions gives
the full layer's loss and gradients, and 16-bit dropout draws keep each element with dropout's
probability, independently, and replay after a restored generator state."""

from __future__ import annotations

import pytest
import torch

from mlm_ddp.config import ModelConfig
from mlm_ddp.data.masking import IGNORE_INDEX
from mlm_ddp.model import fast_paths
from mlm_ddp.model.loading import MaskedLMLoss, wrap_model
from tests.test_model import batch, tiny

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def accelerate_state() -> None:
    from accelerate.state import PartialState

    PartialState()  # wrap_model's log lines go through accelerate's logger, which needs one


def loss_and_grads(net: MaskedLMLoss, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    net.zero_grad()
    loss_sum, n, correct = net(**b)
    loss_sum.backward()
    return torch.stack([loss_sum.detach(), n.float(), correct.float()]), {
        name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("shape", [(4, 24), (3, 7), (1, 40)])
def test_last_layer_on_masked_positions_gives_the_full_loss_and_gradients(kind: str, attention: str,
                                                                           shape: tuple[int, int]) -> None:
    model = tiny(kind).eval()  # dropout off: both paths must see the same computation
    model.set_attn_implementation(attention)
    subset = MaskedLMLoss(model, last_layer_subset=True)
    full = MaskedLMLoss(model)
    assert subset.last_layer_subset and fast_paths.subset_unsupported(model) is None
    for seed in range(3):  # rows with different numbers of masked tokens, one padded row
        b = batch(seed, shape)
        (stats_s, g_s), (stats_f, g_f) = loss_and_grads(subset, b), loss_and_grads(full, b)
        torch.testing.assert_close(stats_s, stats_f, rtol=1e-5, atol=0)
        assert g_s.keys() == g_f.keys() and len(g_s) == len(list(model.parameters()))
        scale = max(float(g.abs().max()) for g in g_f.values())
        for name in g_f:
            torch.testing.assert_close(g_s[name], g_f[name], rtol=1e-5, atol=1e-6 * scale, msg=name)
    # the last layer's feed-forward saw only the masked positions
    seen = []
    model.base_model.encoder.layer[-1].intermediate.register_forward_hook(
        lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    subset(**b)
    assert seen == [(int((b["labels"] != IGNORE_INDEX).sum()), 32)]
    assert "forward" not in model.base_model.encoder.layer[-1].__dict__  # the layer is itself again


def family(kind: str) -> torch.nn.Module:
    """test_model's tiny models, and two families next door whose attention goes through the same
    transformers attention function (neither has a single head module, so no last-layer subset)."""
    if kind in ("bert", "roberta", "distilbert"):
        return tiny(kind)
    import transformers as T

    small = dict(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=80)
    config = T.ElectraConfig(**small) if kind == "electra" else T.ModernBertConfig(
        **small, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    return T.AutoModelForMaskedLM.from_config(config, attn_implementation="sdpa")


def padded_positions_change_nothing(net: MaskedLMLoss) -> bool:
    """Whether what the padded positions hold changes the loss (train mode: the same dropout draws)."""
    b = batch(5)
    other = dict(b, input_ids=torch.where(b["attention_mask"].bool(), b["input_ids"], 7))
    losses = []
    for inputs in (b, other):
        torch.manual_seed(0)
        losses.append(net(**inputs)[0])
    return torch.equal(losses[0], losses[1])


@pytest.mark.parametrize("cfg", [ModelConfig(), ModelConfig(dropout_draws="16bit"),
                                 ModelConfig(dropout_draws="16bit", last_layer_subset=False)])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_padding_stays_invisible_on_every_fast_path(cfg: ModelConfig, mode: str) -> None:
    # padded positions are masked out of every attention, the subset layer's included
    assert padded_positions_change_nothing(getattr(wrap_model(tiny("bert"), cfg, False, CPU), mode)())


@pytest.mark.parametrize("kind", ["roberta", "distilbert", "electra", "modernbert"])
def test_padding_stays_invisible_in_the_families_next_door(kind: str) -> None:
    net = wrap_model(family(kind), ModelConfig(dropout_draws="16bit"), False, CPU).train()
    assert padded_positions_change_nothing(net)


def test_a_micro_batch_without_masked_tokens_keeps_every_parameter_in_the_graph() -> None:
    model = tiny("bert").eval()
    b = batch(4)
    b["labels"][:] = IGNORE_INDEX
    loss_sum, n, _ = MaskedLMLoss(model, last_layer_subset=True)(**b)
    loss_sum.backward()
    assert float(loss_sum.detach()) == 0.0 and int(n) == 0
    assert all(p.grad is not None for p in model.parameters())  # DDP waits for every gradient


@pytest.mark.parametrize("cfg, expected", [
    (ModelConfig(), True),
    (ModelConfig(last_layer_subset=False), False),
    (ModelConfig(mlm_head="all"), False),
    (ModelConfig(gradient_checkpointing=True), False),
])
def test_the_subset_runs_only_where_it_computes_the_same(cfg: ModelConfig, expected: bool) -> None:
    # under --torch_compile it runs too: tests/test_compile.py
    assert wrap_model(tiny("bert"), cfg, False, CPU).last_layer_subset is expected


def test_a_model_without_a_bert_style_layer_falls_back() -> None:
    model = tiny("distilbert")
    assert "encoder.layer" in fast_paths.subset_unsupported(model)
    assert not wrap_model(model, ModelConfig(), False, CPU).last_layer_subset


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_16bit_draws_keep_each_element_with_dropouts_probability_independently(p: float) -> None:
    torch.manual_seed(0)
    n = 4_000_003  # not a multiple of 4: the last 64-bit draw is cut
    keep = fast_paths.keep_mask((n,), p, CPU)
    expected = round((1 - p) * 2**16) / 2**16
    assert abs(expected - (1 - p)) <= 2**-17
    sigma = (expected * (1 - expected) / n) ** 0.5
    assert abs(keep.float().mean().item() - expected) < 5 * sigma
    # the four 16-bit values cut from one 64-bit draw, and neighbours across draws, are independent
    k = keep[: n - n % 4].view(-1, 4).float()
    for a, b in ((0, 1), (1, 2), (2, 3), (0, 3)):
        both = (k[:, a] * k[:, b]).mean().item()
        assert abs(both - expected**2) < 5 * (expected**2 * (1 - expected**2) / len(k)) ** 0.5
    across = (k[:-1, 3] * k[1:, 0]).mean().item()
    assert abs(across - expected**2) < 5 * (expected**2 * (1 - expected**2) / len(k)) ** 0.5


@pytest.mark.parametrize(("p", "kept"), [(1e-6, 1.0), (2**-17, 1.0), (1 - 1e-6, 0.0)])
def test_16bit_draws_at_the_ends_keep_every_element_or_none(p: float, kept: float) -> None:
    """(1-p)·2^16 rounds to 2^16 or to 0: every element kept, or none. Before: p up to 2^-17 kept none (the
    threshold 2^15, compared with int16 values, wrapped to -2^15)."""
    assert fast_paths.keep_mask((1001,), p, CPU).float().mean().item() == kept


def test_dropout16_scales_like_torch_and_replays_from_a_restored_generator() -> None:
    x = torch.randn(64, 128, requires_grad=True)
    state = torch.get_rng_state()
    first = fast_paths.dropout16(x, 0.25)
    kept = first != 0
    torch.testing.assert_close(first[kept], x[kept] / 0.75)  # torch's 1/(1-p) scaling
    first.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.75)  # the same mask in the backward
    torch.set_rng_state(state)  # what a resumed run does: the same draws
    assert torch.equal(fast_paths.dropout16(x, 0.25), first)
    assert fast_paths.dropout16(x, 0.0) is x


def test_16bit_draws_replace_every_dropout_and_the_attention_function() -> None:
    model = tiny("bert").train()
    wrapped = wrap_model(model, ModelConfig(dropout_draws="16bit"), False, CPU)
    kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert kinds == {fast_paths.Dropout16}
    assert model.config._attn_implementation == fast_paths.ATTENTION_DROPOUT16
    # dropout off (eval): the same loss as torch's kernels; on: a different draw, the same expectation
    reference = tiny("bert").eval()
    b = batch(5)
    torch.testing.assert_close(wrapped.eval()(**b)[0], MaskedLMLoss(reference)(**b)[0], rtol=1e-5, atol=1e-5)
    torch.manual_seed(1)
    assert wrapped.train()(**b)[0] != MaskedLMLoss(reference.train())(**b)[0]
    # and torch's kernels where asked
    assert wrap_model(tiny("bert"), ModelConfig(dropout_draws="torch"), False, CPU).draws16 is False


def test_16bit_attention_gives_a_query_with_nothing_to_attend_what_sdpa_gives() -> None:
    """A padded query whose sliding window holds only padding (ModernBERT's local layers) has a mask row of
    False: sdpa makes its output 0 with finite gradients, and so must the 16-bit dropout path. Before: NaN
    there, whose gradient made every parameter's gradient NaN. Dropout 1e-6 keeps every element (its
    threshold rounds to 2^16), so the rest is sdpa's computation scaled by 1/(1-p)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[1, :, 4:, :] = False  # two queries with nothing to attend
    mask[0, :, :, 5] = False  # a padded key
    out = fast_paths.attend(q, k, v, mask, 1e-6, 8**-0.5, draws16=True)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=8**-0.5) / (1 - 1e-6)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1, :, 4:], torch.zeros_like(out[1, :, 4:]))
    out.square().sum().backward()
    assert all(bool(t.grad.isfinite().all()) for t in (q, k, v))
