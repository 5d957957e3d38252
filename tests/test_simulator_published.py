"""The simulator against published at-scale training results (llamatron/planning/simulator/published.yaml; the table in
docs/simulator.md): Llama 2's pretraining GPU-hours on A100-80GB and Megatron-LM's 1T model on 3072 A100s."""

import pytest

from llamatron.planning.simulator.published import published_cases, validate_case

CASES = published_cases()


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_simulator_reproduces_each_published_result_within_30_percent(case):
    v = validate_case(case)
    assert abs(v.error) < 0.30, (case["name"], v.predicted, v.published)


def test_llama2s_total_pretraining_gpu_hours_within_15_percent():
    llama2 = [validate_case(c) for c in CASES if c["name"].startswith("Llama 2")]
    assert len(llama2) == 4
    predicted, published = sum(v.predicted for v in llama2), sum(v.published for v in llama2)
    assert published == 3_311_616  # the paper's total (Table 2)
    assert predicted == pytest.approx(published, rel=0.15)
