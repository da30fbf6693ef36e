"""The benchmarks' training loss hands the EBC a dense, fixed gradient and does nothing else."""

import torch

from benchmarks.models import training_loss


def test_gradient_is_one_dense_tensor_of_the_outputs_shape_the_same_every_step():
    grads = []
    for _ in range(2):
        pooled = torch.randn(8, 24, requires_grad=True)
        training_loss(pooled).backward()
        grads.append(pooled.grad)
    g = grads[0]
    assert g.shape == (8, 24) and all(s > 0 for s in g.stride())  # materialised, not an expanded scalar
    assert g.unique().numel() == g.numel()  # a value per element, unlike sum()'s broadcast one
    assert torch.equal(grads[0], grads[1])  # the same linear function every step


def test_the_loss_is_that_linear_function_and_leaves_the_global_rng_alone():
    pooled = torch.randn(4, 6)
    state = torch.get_rng_state()
    loss = training_loss(pooled)
    assert torch.equal(torch.get_rng_state(), state)
    p = pooled.clone().requires_grad_(True)
    training_loss(p).backward()
    torch.testing.assert_close(loss, (pooled * p.grad).sum())
