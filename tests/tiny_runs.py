"""A tiny single-process training run under ``resilient_loop``: Linear + SGD on random batches.

Shared by the tests that need a real loop and care about what the configuration does, not the model.
"""

from __future__ import annotations

import torch

from resilience import resilient_loop


def attempt(config: dict) -> tuple[BaseException | None, list[int]]:
    """Train a tiny model under ``config``: (the exception raised or None, the steps that ran)."""
    ran: list[int] = []
    try:
        train_xy(config, batches=4, on_step=lambda step: ran.append(step.global_step))
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, ran
    return None, ran


def train_xy(config: dict, *, batches: int = 4, on_step=None):
    """Linear(4, 1) + SGD(lr 0.1), seed 0, on ``batches`` random (x, y) pairs of 2 rows; returns the loop.

    ``on_step(step)`` runs after each optimizer step.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(batches)]
    loop = resilient_loop(config, model=model, optimizer=optimizer, dataloader=data)
    with loop:
        for step in loop:
            x, y = step.batch
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if on_step is not None:
                on_step(step)
    return loop


def train_linear(config: dict, batches: list, *, val: dict[int, float] | None = None) -> list[tuple[int, float]]:
    """Linear(2, 1) + SGD(lr 0.01), seed 0, on ``batches`` (tensors of 2 columns), its loss logged
    and ``val[step]`` logged as ``val_loss`` at those steps; returns ``(global step, loss)`` per step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    with resilient_loop(config, model=model, optimizer=optimizer, dataloader=batches) as loop:
        for step in loop:
            optimizer.zero_grad()
            loss = model(step.batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            loop.log(loss=loss.item())
            losses.append((step.global_step, loss.item()))
            if val and step.global_step in val:
                loop.log_validation(val_loss=val[step.global_step])
    return losses
