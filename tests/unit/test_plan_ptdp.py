"""The performance model on paper: Megatron-LM's PTD-P weak-scaling table (hpctrain/plan/ptdp.py)."""
import pytest

from hpctrain.plan.ptdp import TABLE_1, plan_row, predict_row


@pytest.mark.parametrize("row", TABLE_1, ids=[r.preset for r in TABLE_1])
def test_predicted_tflops_per_gpu_within_10_percent_of_the_published(row):
    predicted = predict_row(row).tflops_per_device
    assert abs(predicted / row.published_tflops - 1) <= 0.10, (row, predicted)


@pytest.mark.parametrize("row", TABLE_1, ids=[r.preset for r in TABLE_1])
def test_plan_keeps_tp_inside_a_node_and_ranks_the_papers_layout_near_the_top(row):
    result = plan_row(row)
    best = result.plans[0]
    assert best.placement["tp"] == "intra" and best.candidate.layout.tp_size <= 8
    lay = best.candidate.layout
    if lay.pp_size > 1:  # tp fills the node first, the pipeline goes across nodes once tp x pp exceeds it
        assert best.placement["pp"] == ("intra" if lay.tp_size * lay.pp_size <= 8 else "inter")
    assert predict_row(row).tflops_per_device >= 0.9 * best.tflops_per_device


@pytest.mark.parametrize("row", [r for r in TABLE_1 if r.gpus >= 1920], ids=lambda r: r.preset)
def test_plan_picks_tp8_and_pipelines_across_nodes_for_the_largest_models(row):
    lay = plan_row(row).plans[0].candidate.layout
    assert lay.tp_size == 8 and lay.pp_size > 1
