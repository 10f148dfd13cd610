"""fastdp.dpfp.DPForwardPass: the covered case is enforced (refusals name the parameters), the opt-in reports "not
covered", steps are counted and epsilon is the accounting module's."""

from __future__ import annotations

import warnings

import pytest
import torch
from model_oracle import bert, cls_batches
from torch import nn

from fastdp.dpfp import DPForwardPass, UncoveredTrainingError, dpfp_epsilon, paper_epsilon

KW = dict(clip_norm=1.0, sample_size=200, micro_batches=4, batch_size=8, delta=1e-4)


class Net(nn.Module):
    def __init__(self, skip=False, bn=False):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)) if bn else nn.Linear(4, 6)
        self.classifier = nn.Linear(6, 2)
        self.skip = skip

    def forward(self, x):
        h = self.enc(x)
        out = self.classifier(h)
        return out + h[:, :2] if self.skip else out


def frozen(net):
    net.enc.requires_grad_(False)
    return net


def test_refuses_trainable_below_at_construction_naming_them():
    with pytest.raises(UncoveredTrainingError, match=r"enc\.weight, enc\.bias.*requires_grad_\(False\)"):
        DPForwardPass(Net(), noise_multiplier=1.0, **KW)


def test_unfrozen_later_refused_at_forward_and_at_step():
    net = frozen(Net())
    dp = DPForwardPass(net, noise_multiplier=1.0, **KW)
    net(torch.randn(3, 4))
    dp.step()
    net.enc.bias.requires_grad_(True)
    with pytest.raises(UncoveredTrainingError, match=r"enc\.bias"):
        net(torch.randn(3, 4))
    with pytest.raises(UncoveredTrainingError, match=r"enc\.bias"):
        dp.step()
    assert dp.steps_taken == 1
    net.eval()
    net(torch.randn(3, 4))  # evaluation does not train anything: allowed


def test_tied_parameter_counts_as_below():
    net = Net()
    net.classifier = nn.Linear(6, 6)
    net.enc = nn.Linear(6, 6)
    net.classifier.weight = net.enc.weight  # shared between the head and the encoder
    net.enc.bias.requires_grad_(False)
    with pytest.raises(UncoveredTrainingError, match=r"enc\.weight"):
        DPForwardPass(net, noise_multiplier=1.0, **KW)


def test_batchnorm_below_in_training_mode_refused():
    net = frozen(Net(bn=True))
    with pytest.raises(UncoveredTrainingError, match=r"BatchNorm.*enc\.1"):
        DPForwardPass(net, noise_multiplier=1.0, **KW)
    net.enc.eval()
    DPForwardPass(net, noise_multiplier=1.0, **KW)


def test_path_around_the_noise_layer_refused():
    net = frozen(Net(skip=True))
    DPForwardPass(net, noise_multiplier=1.0, **KW)
    net(torch.randn(1, 4))  # one sample: the check waits for two
    with pytest.raises(UncoveredTrainingError, match="bypasses the noise layer"):
        net(torch.randn(3, 4))


def test_opt_in_reports_not_covered():
    net = Net()
    with pytest.warns(UserWarning, match="NOT covered"):
        dp = DPForwardPass(net, noise_multiplier=1.0, allow_uncovered_encoder_training=True, **KW)
    net(torch.randn(3, 4))
    dp.step()
    spent = dp.get_privacy_spent()
    assert not spent.covered and spent.epsilon is None and spent.paper_epsilon is None
    assert "not covered" in str(spent) and dp.get_epsilon() == float("inf")
    net.enc.requires_grad_(False)  # refreezing does not make the run covered again
    dp.step()
    assert not dp.get_privacy_spent().covered


def test_opt_in_later_unfreeze_marks_not_covered():
    net = frozen(Net())
    dp = DPForwardPass(net, noise_multiplier=1.0, allow_uncovered_encoder_training=True, **KW)
    dp.step()
    assert dp.get_privacy_spent().covered
    net.enc.weight.requires_grad_(True)
    with pytest.warns(UserWarning, match="NOT covered"):
        net(torch.randn(2, 4))
    assert not dp.get_privacy_spent().covered


def test_covered_epsilon_and_target():
    net = frozen(Net())
    dp = DPForwardPass(net, target_epsilon=2.0, epochs=3, **KW)
    p = 8 / (4 * 200)
    assert dp.sample_rate == pytest.approx(p) and dp.planned_steps == 75
    assert dp.get_privacy_spent().epsilon == 0.0
    s = dp.noise.noise_multiplier
    for _ in range(75):
        dp.step()
    spent = dp.get_privacy_spent()
    assert spent.covered and spent.steps == 75
    assert spent.epsilon == pytest.approx(dpfp_epsilon(s, p, 4, 75, 1e-4), rel=1e-12)
    assert 2.0 * 0.99 <= spent.epsilon <= 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert spent.paper_epsilon == pytest.approx(paper_epsilon(s, p, 4, 75, 1e-4), rel=1e-12)
    assert spent.paper_epsilon < spent.epsilon and "not a guarantee" in str(spent)
    with pytest.warns(UserWarning, match="more than the 75 planned"):
        dp.step()


def test_noise_applied_only_in_training_and_removable():
    torch.manual_seed(0)
    net = frozen(Net())
    x = torch.randn(5, 4)
    plain = net(x)
    dp = DPForwardPass(net, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0), **KW)
    assert not torch.allclose(net(x), plain)
    net.eval()
    assert torch.allclose(net(x), plain)
    net.train()
    dp.remove()
    assert torch.allclose(net(x), plain)


def test_bad_arguments():
    net = frozen(Net())
    with pytest.raises(ValueError, match="exactly one of noise_multiplier"):
        DPForwardPass(net, **KW)
    with pytest.raises(ValueError, match="planned run"):
        DPForwardPass(net, target_epsilon=1.0, **KW)
    with pytest.raises(ValueError, match="must be > 0"):
        DPForwardPass(net, noise_multiplier=0.0, **KW)
    with pytest.raises(ValueError, match="no submodule head='head'"):
        DPForwardPass(net, head="head", noise_multiplier=1.0, **KW)


def test_hf_bert_classifier():
    torch.manual_seed(0)
    model = bert()
    ((ids, mask), y), = cls_batches([4], seed=0)
    with pytest.raises(UncoveredTrainingError, match=r"bert\.embeddings\.word_embeddings\.weight"):
        DPForwardPass(model, noise_multiplier=1.0, **KW)
    model.bert.requires_grad_(False)
    dp = DPForwardPass(model, noise_multiplier=0.5, **KW)
    seen = {}
    model.classifier.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0]))
    model.train()
    out = model(input_ids=ids, attention_mask=mask).logits
    assert dp.path_verified  # the only path to the logits goes through the classifier's input
    assert out.shape == (4, model.config.num_labels)
    loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    assert model.classifier.weight.grad is not None
    assert all(p.grad is None for p in model.bert.parameters())
    dp.step()
    assert dp.get_privacy_spent().covered
    # the noise point can also be the pooler's output
    dp.remove()
    dp2 = DPForwardPass(model, noise_at="bert.pooler", noise_multiplier=0.0 + 1e-9, **KW)
    model(input_ids=ids, attention_mask=mask)
    assert (seen["h"].norm(dim=1) <= 1.0 + 1e-5).all()  # clipped to C = 1 (noise ~ 1e-9)
    dp2.remove()


def test_empty_and_single_sample_batches():
    net = frozen(Net())
    dp = DPForwardPass(net, noise_multiplier=1.0, **KW)
    assert net(torch.randn(0, 4)).shape == (0, 2)
    assert net(torch.randn(1, 4)).shape == (1, 2)
    assert not dp.path_verified  # needs two samples
    assert dp.verify_path(torch.randn(6, 4)) and dp.path_verified  # B = 6 = the representation size
    dp.step()
    assert dp.get_privacy_spent().covered


def test_secure_mode_sampler():
    dp = DPForwardPass(frozen(Net()), noise_multiplier=1.0, secure_mode=True, **KW)
    assert dp.noise.secure_mode and dp.sampler().secure_mode
    assert not dp.sampler(generator=torch.Generator().manual_seed(0)).secure_mode
