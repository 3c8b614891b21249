"""``attach(..., activations=...)`` accepts modules, names and mappings."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.torch import attach  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()) for _ in range(3))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _one_step(activations):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = attach(model, opt, activations=activations(model) if callable(activations)
                   else activations, activation_every=1, checkpoint_every=0)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    sig = guard.collect(loss)
    return guard, sig


@pytest.mark.parametrize("acts", [
    lambda m: [m.blocks[0], m.blocks[-1]],          # the README's form: modules
    ["blocks.0", "blocks.2"],                       # names
    lambda m: ["blocks.0", m.blocks[2]],            # a mix
    lambda m: {"blocks.0": m.blocks[0], "blocks.2": m.blocks[2]},
])
def test_modules_and_names_give_the_same_signals(acts) -> None:
    guard, sig = _one_step(acts)
    assert guard.collector.act_names == ["blocks.0", "blocks.2"]
    assert sig.families["act_std"].shape == (2,)
    ref_guard, ref = _one_step(["blocks.0", "blocks.2"])
    for k in ("act_mean", "act_std", "act_absmax", "act_kurtosis"):
        assert sig.families[k].tolist() == ref.families[k].tolist()


def test_single_module_and_whole_model() -> None:
    guard, sig = _one_step(lambda m: m.head)
    assert guard.collector.act_names == ["head"]
    guard, sig = _one_step(lambda m: [m])
    assert guard.collector.act_names == ["model"]


def test_foreign_module_or_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not part of the model: Linear"):
        _one_step(lambda m: [torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="'blocks.9'"):
        _one_step(["blocks.9"])
