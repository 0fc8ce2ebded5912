"""Tests for the model zoo: ``omnilearn.experiments.zoo.models``, ``omnilearn.experiments.zoo.vision``, ``omnilearn.experiments.zoo.gpt``.

Every model in ``MODELS`` is built on a small input, checked for its output
shape and trained a few SGD steps on one fixed batch, which must lower the
loss. Parameter counts are pinned; GPT-2 small is built on the meta device
so its 124M parameters cost nothing. Run: ``python -m pytest -q tests/unit/test_models.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from omnilearn.experiments.zoo import models
from omnilearn.experiments.zoo.gpt import GPT, GPTConfig

VOCAB, SEQ = 256, 32
# (input_shape, num_classes, SGD learning rate) per model for the fit test; the rates
# were checked to lower the loss over several seeds, not just the one used here.
CASES = {
    "cnn1d": ((40,), 10, 0.05),
    "mlp": ((40,), 10, 0.05),
    "resnet18": ((3, 16, 16), 10, 0.01),
    "resnet50": ((3, 16, 16), 10, 0.005),
    "alexnet": ((3, 32, 32), 10, 0.05),
    "vgg11": ((3, 16, 16), 10, 0.01),
    "gpt2": ((SEQ,), VOCAB, 0.02),
    "gpt2-tiny": ((SEQ,), VOCAB, 0.1),
}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def batch(name: str, shape: tuple[int, ...], classes: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if models.is_language_model(name):
        tokens = torch.randint(0, classes, (n, shape[0] + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn((n, *shape), generator=g), torch.randint(0, classes, (n,), generator=g)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)  # the same dropout mask every call: one fixed objective
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def test_model_list_covers_cases() -> None:
    assert set(models.MODELS) == set(CASES)
    assert [m for m in models.MODELS if models.is_language_model(m)] == ["gpt2", "gpt2-tiny"]


@pytest.mark.parametrize("name", models.MODELS)
def test_output_shape_and_fits_fixed_batch(name: str) -> None:
    shape, classes, lr = CASES[name]
    torch.manual_seed(0)
    model = models.build(name, shape, classes)
    x, y = batch(name, shape, classes, n=2)  # batch of 2: BatchNorm in train mode must cope
    model.train()
    expected = (2, shape[0], classes) if models.is_language_model(name) else (2, classes)
    assert model(x).shape == expected
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    before = loss_of(model, x, y).item()
    for _ in range(5):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    after = loss_of(model, x, y).item()
    assert after < before, f"{name}: loss {before:.4f} -> {after:.4f}"


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "alexnet", "vgg11"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (5, 9, 13)])
def test_vision_any_channels_and_small_images(name: str, shape: tuple[int, ...]) -> None:
    model = models.build(name, shape, 7).eval()
    with torch.no_grad():
        assert model(torch.randn(3, *shape)).shape == (3, 7)


def test_vision_param_count_does_not_depend_on_image_size() -> None:
    for name in ("alexnet", "vgg11"):
        assert n_params(models.build(name, (3, 8, 8), 10)) == n_params(models.build(name, (3, 64, 64), 10))


@pytest.mark.parametrize("name, classes, expected", [
    ("resnet18", 10, 11_173_962),
    ("resnet50", 100, 23_705_252),
    ("alexnet", 10, 4_361_034),
    ("vgg11", 10, 9_231_114),
])
def test_vision_param_counts(name: str, classes: int, expected: int) -> None:
    with torch.device("meta"):
        model = models.build(name, (3, 32, 32), classes)
    assert abs(n_params(model) - expected) <= 0.001 * expected


def test_gpt2_has_the_real_124m_shape() -> None:
    with torch.device("meta"):
        model = models.build("gpt2", (SEQ,), 50257)
    assert model.cfg == GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert abs(n_params(model) - 124.4e6) <= 0.5e6
    assert model.lm_head.weight is model.wte.weight


def test_gpt_block_size() -> None:
    with torch.device("meta"):
        assert models.build("gpt2", (2048,), VOCAB).cfg.block_size == 2048
        assert models.build("gpt2-tiny", (SEQ,), VOCAB).cfg.block_size == SEQ
    model = models.build("gpt2-tiny", (8,), VOCAB)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = models.build("gpt2-tiny", (16,), VOCAB).eval()
    x = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        base = model(x)
        for t in (0, 7, 14):
            changed = x.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % VOCAB
            out = model(changed)
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1])
            assert not torch.allclose(out[:, t + 1], base[:, t + 1])


def test_gpt_residual_init_is_scaled() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=8, n_head=4, n_embd=256))
    proj = torch.cat([b.mlp.c_proj.weight.flatten() for b in model.blocks])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in model.blocks])
    assert proj.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert fc.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_embd=130, n_head=4), "divisible by n_head"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(block_size=2.5), "block_size"),
    (dict(dropout=1.0), "dropout"),
])
def test_gpt_config_validation(kwargs: dict, match: str) -> None:
    args = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=128) | kwargs
    with pytest.raises(ValueError, match=match):
        GPTConfig(**args)


def test_gpt_config_is_frozen() -> None:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=128)
    with pytest.raises(AttributeError):
        cfg.n_layer = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "alexnet", "vgg11"])
def test_vision_rejects_flat_input_helpfully(name: str) -> None:
    with pytest.raises(ValueError) as err:
        models.build(name, (40,), 10)
    message = str(err.value)
    assert "\n" not in message
    assert f"model {name} needs image inputs (channels, height, width)" in message
    assert "(40,)" in message and "--input-shape 3x32x32" in message


@pytest.mark.parametrize("name", ["gpt2", "gpt2-tiny"])
def test_gpt_rejects_images_helpfully(name: str) -> None:
    with pytest.raises(ValueError, match=rf"model {name} needs token sequences .*\(3, 32, 32\)"):
        models.build(name, (3, 32, 32), 10)


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="unknown model 'nope'; choose one of cnn1d, mlp, resnet18"):
        models.build("nope", (40,), 10)


def test_old_models_unchanged() -> None:
    cnn1d = 64 * 5 + 64 + 2 * (64 * 64 * 3 + 64) + 64 * 10 * 10 + 10  # convs, then head on 10 positions
    assert n_params(models.build("cnn1d", (40,), 10)) == cnn1d
    assert n_params(models.build("mlp", (40,), 10)) == 40 * 256 + 256 + 256 * 10 + 10
