"""harness/train/zero0_step.py on a real one-rank DeepSpeed ZeRO-0 engine (gloo, in this process): the global grad norm
DeepSpeed does not report for fp32 is the float64 norm of the unclipped gradients, with clipping off (measured at the
optimizer's step) and on (measured before the engine's clip, which still clips); the all-reduce over the one rank is
skipped and nothing changes (losses and weights bit-equal to an engine that runs it); a bf16 engine keeps its own."""

from __future__ import annotations

import pytest
import torch

from harness.train import zero0_step
from helpers.deepspeed_verdict import gloo_world_of_one


def _engine(clipping: float, precision: str = "fp32", install: bool = True):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    config = {"train_batch_size": 4, "gradient_clipping": clipping, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, (zero0_step.install(engine) if install else False)


def _steps(engine, n: int = 3) -> tuple[list[float], list]:
    losses, norms, gen = [], [], torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(4, 16, generator=gen).to(engine.device)
        loss = (engine(x.to(next(engine.module.parameters()).dtype)).float() ** 2).sum() * 10
        engine.backward(loss)
        want = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in engine.module.parameters()]))
        engine.step()
        losses.append(float(loss.detach()))
        norms.append((engine.get_global_grad_norm(), float(want)))
    return losses, norms


@pytest.mark.parametrize("clipping", [0.0, 1.0])
def test_zero0_fp32_reports_the_float64_norm_of_the_unclipped_gradients(clipping):
    with gloo_world_of_one():
        engine, installed = _engine(clipping)
        losses, norms = _steps(engine)
        plain, _ = _engine(clipping, install=False)
        assert engine.enable_backward_allreduce is False and plain.enable_backward_allreduce is True
        assert installed and plain.get_global_grad_norm() is None
        # clipping 1.0 bites (norms ~10): the reported norm is the one before the clip, as ZeRO-1/2/3 report it
        assert all(abs(float(got) - want) <= 1e-12 * want for got, want in norms), norms
        assert clipping == 0 or min(want for _, want in norms) > 1.0
        plain_losses, _ = _steps(plain)
        assert losses == plain_losses  # the skipped all-reduce over one rank changed nothing
        assert all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), plain.module.parameters()))


def test_a_bf16_engine_keeps_its_own_norm():
    with gloo_world_of_one():
        engine, installed = _engine(1.0, "bf16")
        _, norms = _steps(engine, 1)
        assert not installed and engine.enable_backward_allreduce is True
        assert norms[0][0] is not None and abs(float(norms[0][0]) - norms[0][1]) <= 1e-2 * norms[0][1]
