"""The zero-bubble weight pass's rules (pipe/weight_grad.py) against autograd."""
import pytest
import torch

from dsrun.runtime.parallel.pipe.weight_grad import has_rule, weight_grads


def _autograd_grads(module, x, dy):
    """The parameter gradients autograd gives for module(x) with output gradient dy."""
    module.zero_grad(set_to_none=True)
    module(x).backward(dy)
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def _check(module, x):
    torch.manual_seed(1)
    with torch.no_grad():
        dy = torch.randn_like(module(x), dtype=torch.float32)
    expected = _autograd_grads(module, x, dy)
    names = {id(p): n for n, p in module.named_parameters()}
    found = weight_grads(module, x, dy)
    assert sorted(names[id(p)] for p, _ in found) == sorted(expected)
    for p, g in found:
        assert g.dtype == p.dtype and g.shape == p.shape
        torch.testing.assert_close(g, expected[names[id(p)]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 6)])
def test_linear(bias, shape):
    torch.manual_seed(0)
    _check(torch.nn.Linear(6, 4, bias=bias), torch.randn(*shape))


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(affine):
    torch.manual_seed(0)
    module = torch.nn.LayerNorm(6, elementwise_affine=True, bias=affine)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    _check(module, torch.randn(2, 3, 6) * 3 + 1)


def test_embedding_with_repeated_indices_and_padding():
    torch.manual_seed(0)
    module = torch.nn.Embedding(7, 4, padding_idx=2)
    _check(module, torch.tensor([[1, 2, 1, 6], [2, 0, 1, 1]]))


def test_frozen_parameter_is_left_out():
    module = torch.nn.Linear(6, 4)
    module.bias.requires_grad_(False)
    found = weight_grads(module, torch.randn(3, 6), torch.randn(3, 4))
    assert [p for p, _ in found] == [module.weight]


def test_rules_cover_exact_classes_and_plain_options_only():
    class MyLinear(torch.nn.Linear):
        def forward(self, x):
            return super().forward(2 * x)

    assert has_rule(torch.nn.Linear(2, 2)) and has_rule(torch.nn.LayerNorm(2)) and has_rule(torch.nn.Embedding(3, 2))
    assert not has_rule(MyLinear(2, 2)), "a subclass may change the forward the rule assumes"
    assert not has_rule(torch.nn.Embedding(3, 2, max_norm=1.0))
    assert not has_rule(torch.nn.Embedding(3, 2, sparse=True))
    assert not has_rule(torch.nn.Conv1d(2, 2, 1))
