"""DPO loss (Rafailov et al. 2023 eq. 7; online as in Noukhovitch et al. 2024) vs hand-computed values."""

import math

import pytest
import torch

from megatron_rlhf.losses.dpo import dpo_loss

pytestmark = pytest.mark.timeout(30)


def test_dpo_loss_hand_computed():
    # pair 0: policy-ref log-ratios chosen = -10 - (-11) = 1, rejected = -12 - (-11.5) = -0.5
    #         margin = beta * (1 - (-0.5)) = 0.1 * 1.5 = 0.15 ; -log sigmoid(0.15) = log(1 + e^-0.15)
    # pair 1: chosen = -5 - (-4) = -1, rejected = -6 - (-6) = 0 ; margin = 0.1 * (-1) = -0.1
    #         -log sigmoid(-0.1) = log(1 + e^0.1)
    pc, pr = torch.tensor([-10.0, -5.0]), torch.tensor([-12.0, -6.0])
    rc, rr = torch.tensor([-11.0, -4.0]), torch.tensor([-11.5, -6.0])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.1)
    expected = (math.log(1 + math.exp(-0.15)) + math.log(1 + math.exp(0.1))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)      # = 0.6807...
    assert m["dpo/accuracy"].item() == pytest.approx(0.5)
    assert m["dpo/margin"].item() == pytest.approx((0.15 - 0.1) / 2, abs=1e-6)


def test_dpo_loss_at_reference_is_log2_and_gradient_sign():
    pc = torch.tensor([-3.0], requires_grad=True)
    pr = torch.tensor([-4.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, pc.detach(), pr.detach(), beta=0.5)
    assert loss.item() == pytest.approx(math.log(2))
    loss.backward()
    # d/dpc of -log sigmoid(beta*(pc - pr ...)) at margin 0 = -beta * sigmoid(0) = -0.25
    assert pc.grad.item() == pytest.approx(-0.25) and pr.grad.item() == pytest.approx(0.25)


def test_dpo_loss_rejects_bad_input():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="same shape"):
        dpo_loss(t, torch.zeros(3), t, t, beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(t, t, t, t, beta=0.0)
