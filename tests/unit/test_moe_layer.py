"""The MoE layer on one process (float64): its routing, capacity and experts against a plain per-token loop, the
auxiliary losses' gradient against finite differences of the objective they define, and the bad [moe] keys."""
import math

import pytest
import torch
import torch.nn.functional as F

from hpctrain.config import ConfigError, load_config, resolve_model
from hpctrain.config.moe_keys import resolve_moe
from hpctrain.models.gpt import GPTStage
from hpctrain.models.moe import capacity_slots


def model(*overrides, layers=(0, 2)):
    cfg = load_config(None, ["moe.num_experts=4", f"moe.layers={list(layers)}", *overrides])
    m = resolve_model(cfg.model)
    return GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=torch.float64,
                    moe=resolve_moe(cfg.moe, m)), resolve_moe(cfg.moe, m)


def reference_moe(layer, x, moe):
    """The layer's output by a loop over tokens and their choices (Mixtral's definition), with the capacity
    rule written out: per sequence, first choices first, then by position."""
    s, b, d = x.shape
    logits = x.reshape(-1, d) @ layer.router.weight.T
    probs = torch.softmax(logits, -1)
    w, e = probs.topk(moe.top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    e, w = e.view(s, b, -1), w.view(s, b, -1)
    cap = math.ceil(moe.capacity_factor * s * moe.top_k / moe.num_experts) if moe.capacity_factor else None
    out = torch.zeros_like(x)
    ex = layer.experts
    for col in range(b):
        served = [0] * moe.num_experts
        for j in range(moe.top_k):
            for pos in range(s):
                k = int(e[pos, col, j])
                if cap is not None and served[k] >= cap:
                    continue
                served[k] += 1
                t = x[pos, col]
                y = ex.down[k] @ (F.silu(ex.gate[k] @ t) * (ex.up[k] @ t))
                out[pos, col] += w[pos, col, j] * y
    if moe.shared_experts:
        out = out + layer.shared(x)
    return out


@pytest.mark.parametrize("overrides", [[], ["moe.capacity_factor=0.5"], ["moe.shared_experts=1", "moe.top_k=1"],
                                       ["moe.top_k=3", "moe.capacity_factor=1.0"]])
def test_the_layer_equals_a_loop_over_tokens(overrides):
    torch.manual_seed(1)
    stage, moe = model(*overrides)
    layer = stage.layers["0"].moe
    x = torch.randn(12, 3, 64, dtype=torch.float64)
    layer.eval()
    torch.testing.assert_close(layer(x), reference_moe(layer, x, moe), rtol=0, atol=1e-12)


def test_capacity_slots_count_first_choices_first_then_positions():
    experts = torch.tensor([[[0, 1]], [[1, 0]], [[0, 1]]])  # [S=3, B=1, k=2]
    slots = capacity_slots(experts, 2)[:, 0]
    # first choices: pos0->0 (slot 0), pos1->1 (0), pos2->0 (1); then second: pos0->1 (1), pos1->0 (2), pos2->1 (2)
    assert slots.tolist() == [[0, 1], [0, 2], [1, 2]]


def test_the_auxiliary_losses_gradient_is_that_of_the_objective_they_define():
    """d/dθ of weight x (token losses + sum over MoE layers of aux_coef S balance + z_coef sum lse^2), the
    objective ``MoeStats`` reports the parts of, by central differences on a router weight and an expert."""
    torch.manual_seed(2)
    stage, moe = model("moe.aux_loss_coef=0.5", "moe.z_loss_coef=0.1", "moe.capacity_factor=2.0")
    stage.train()
    ids, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    weight = 1 / 32

    def objective():
        for block in (stage.layers["0"], stage.layers["2"]):
            block.moe.stats.clear()
        stage.aux_weight.value = weight
        loss = stage.forward_loss(ids, targets)
        extra = sum(moe.aux_loss_coef * 16 * b.moe.stats.aux + moe.z_loss_coef * b.moe.stats.z
                    for b in (stage.layers["0"], stage.layers["2"]))
        return loss, weight * (float(loss.detach()) + extra)

    loss, _ = objective()
    (loss * weight).backward()
    for param, index in ((stage.layers["0"].moe.router.weight, (1, 3)), (stage.layers["2"].moe.experts.up, (2, 5, 7))):
        h = 1e-6
        with torch.no_grad():
            param[index] += h
        plus = objective()[1]
        with torch.no_grad():
            param[index] -= 2 * h
        minus = objective()[1]
        with torch.no_grad():
            param[index] += h
        assert param.grad is not None
        numeric = (plus - minus) / (2 * h)
        assert abs(float(param.grad[index]) - numeric) < 1e-7 * max(1.0, abs(numeric)), (param.grad[index], numeric)
        assert abs(numeric) > 1e-6  # the test sees the gradient, not two zeros


@pytest.mark.parametrize("overrides,key", [
    (["moe.top_k=3"], "moe.top_k: is set but moe.num_experts is 0"),
    (["moe.top_k=2"], "moe.top_k: is set but moe.num_experts is 0"),  # at its default value too (issue #55)
    (["parallel.ep=2"], "parallel.ep: 2 splits experts"),
    (["moe.num_experts=4", "moe.top_k=5"], "moe.top_k: 5 exceeds moe.num_experts=4"),
    (["moe.num_experts=4", "moe.layers=[9]"], "moe.layers: [9] are not blocks"),
    (["moe.num_experts=4", "moe.layers=[1,1]"], "moe.layers: names a block twice"),
    (["moe.num_experts=4", "parallel.ep=3"], "parallel.ep: 3 does not divide moe.num_experts=4"),
    (["moe.num_experts=4", "moe.capacity_factor=-1"], "moe.capacity_factor: must be >= 0"),
])
def test_bad_moe_keys_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match="config: " + key.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, overrides)


def test_a_moe_section_without_experts_is_refused_whatever_its_values(tmp_path):
    """A TOML ``[moe]`` with only ``top_k = 2`` (its default) asked for experts: refused, never a dense run."""
    config = tmp_path / "c.toml"
    config.write_text("[moe]\ntop_k = 2\n")
    with pytest.raises(ConfigError, match="moe.top_k: is set but moe.num_experts is 0"):
        load_config(str(config))
    config.write_text("[moe]\nnum_experts = 4\ntop_k = 2\n")
    assert load_config(str(config)).moe.num_experts == 4
