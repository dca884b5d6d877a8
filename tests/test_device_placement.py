"""Issue 29, finding 1: on CUDA, TRL's completion_mask lives on the GPU while the rewards-side arithmetic of
lemon.train.cf.step_advantages ran on CPU tensors, so every CUDA run failed at its first step with "Expected all tensors
to be on the same device". The meta device stands in for CUDA here: any op mixing a CPU (B,) / (B, T) tensor with a meta
one raises the same error, so these tests fail on the old code without a GPU. tests/test_gpu.py and scripts/gpu_check.sh
check the same path on a real GPU."""
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from lemon.train.cf import step_advantages  # noqa: E402


def test_step_advantages_follow_the_mask_device():
    cmask = torch.ones(4, 6, device="meta")  # (B, T) as TRL hands it over on a GPU
    smask = torch.zeros(4, 6)  # (B, T) built by the trainer; it may be on either device
    adv, keep, s = step_advantages([1.0, 0.0, None, 0.5], [0, 0, 1, 1], [0.3, 0.0, 0.0, 0.0], cmask, smask, lam=1.0)
    assert adv.device.type == "meta" and adv.shape == (4, 6) and keep.device.type == "meta"
    # the logged scale is computed on the CPU side, never read back from the device
    assert isinstance(s, float) and s > 0
    (cmask * keep[:, None].to(cmask.dtype))  # the mixin's masking of errored rollouts: same device, no error


def test_the_trainer_mixin_builds_advantages_on_the_mask_device():
    """CFGRPOMixin._generate_and_score_completions over a stand-in TRL base that returns meta-device tensors."""
    from lemon.train.grpo import CFGRPOMixin
    from lemon.train.rewards import RewardBreakdown
    from lemon.train.scoring import Rollout

    class Base:  # what TRL's GRPOTrainer._generate_and_score_completions returns, on the GPU
        def _generate_and_score_completions(self, inputs):
            return {"completion_mask": torch.ones(2, 5, dtype=torch.long, device="meta"),
                    "advantages": torch.zeros(2, device="meta")}

    class T(CFGRPOMixin, Base):
        def __init__(self, rollouts):  # skip TRL's constructor: only the overridden method is under test
            self.rollouts = rollouts
            self.logged = None

        def _log_rollouts(self, recs, scale):
            self.logged = scale

    br = RewardBreakdown(total=0.5, success=1.0, token_efficiency=0.5, graph_cost=0.0, valid=True, worker_tokens=10)
    recs = [Rollout("q", "spec", (1, 2, 3), 0, True, None, br), Rollout("q", "spec", (1, 2), 0, True, None, br)]
    recs[0].delta, recs[0].span_positions, recs[0].cf_status = 1.0, (1, 2), "ok"
    rollouts = SimpleNamespace(batch=recs, cf_lambda=1.0, scale_rewards="batch", std_floor=0.1)
    t = T(rollouts)
    out = t._generate_and_score_completions({})
    assert out["advantages"].device.type == "meta" and out["advantages"].shape == (2, 5)
    assert out["completion_mask"].device.type == "meta"
    assert t.logged == pytest.approx(0.1)  # equal rewards: the scale is the floor
