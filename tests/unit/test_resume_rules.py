"""What a resume refuses before reading a byte, and what pruning keeps (no MPI): the architecture keys of a
checkpoint (recorded, or derived from an older one's config), 1-bit Adam's warm-up rule, and the markers of
steps another run refers to as its LoRA base."""
import re
from types import SimpleNamespace

import pytest

from hpctrain.checkpoint.architecture import of_checkpoint, record
from hpctrain.checkpoint.compression_state import OTHER_FREEZE, check_onebit_adam
from hpctrain.checkpoint.items import CheckpointError
from hpctrain.checkpoint.references import mark, referenced
from hpctrain.config import ModelConfig, architecture, architecture_differences, config_to_dict, load_config


def test_architecture_keys_are_recorded_or_derived_and_every_difference_is_named():
    cfg = load_config(None, ["model.positions=learned", "model.vocab_multiple=64"])
    attrs = {"config": config_to_dict(cfg)}
    derived = of_checkpoint(attrs)  # a checkpoint written before the attribute existed
    assert derived == architecture(cfg.model) == record(cfg.model)["keys"] and derived["max_seq_len"] == 256
    assert "vocab_multiple" not in derived and "init_std" not in derived  # padding and init: not the model
    assert of_checkpoint({**attrs, "architecture": {"keys": {**derived, "n_layers": 9}}})["n_layers"] == 9
    ours = ModelConfig(n_layers=2, rope_theta=500000.0, positions="learned", max_seq_len=128)
    assert architecture_differences(derived, ours) == [
        "model.n_layers is 4 there, 2 here", "model.rope_theta is 10000.0 there, 500000.0 here",
        "model.max_seq_len is 256 there, 128 here"]
    assert "max_seq_len" not in architecture(ModelConfig())  # rope: the context length is no weight


@pytest.mark.parametrize("theirs,ours,steps,refused", [
    (2, 10, 3, True),   # frozen at 2: another warm-up would thaw it
    (5, 3, 4, True),    # not frozen yet, but 4 steps already: it would freeze behind the run
    (5, 3, 3, False),   # inside the warm-up, freezing at the next step: as a run with 3 would
    (5, 8, 4, False),   # a longer warm-up before the freeze
    (2, 2, 7, False)])
def test_onebit_adam_warmup_may_change_only_inside_the_warmup(theirs, ours, steps, refused):
    def cfg(warmup):
        return load_config(None, ["compression.method=onebit-adam", f"compression.warmup_steps={warmup}"])

    state = SimpleNamespace(config=cfg(ours))
    reader = SimpleNamespace(attrs={"config": config_to_dict(cfg(theirs)), "optimizer_step": steps}, path="ckpt")
    if refused:
        with pytest.raises(CheckpointError, match=f"compression.warmup_steps={ours}: .*{re.escape(OTHER_FREEZE)}"):
            check_onebit_adam(state, reader)
    else:
        check_onebit_adam(state, reader)


def test_a_reference_marker_names_the_step_and_the_referring_run(tmp_path):
    step = tmp_path / "base" / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    assert mark(str(step), str(tmp_path / "lora")) is None  # no checkpoint.h5: not a step directory
    (step / "checkpoint.h5").write_bytes(b"")
    path, new = mark(str(step), str(tmp_path / "lora"))
    assert new and mark(str(step), str(tmp_path / "lora")) == (path, False)
    assert referenced(str(tmp_path / "base" / "checkpoints")) == {"step-00000004": [(path, str(tmp_path / "lora"))]}
    assert mark(str(tmp_path / "hf"), "x") is None and referenced(str(tmp_path)) == {}
