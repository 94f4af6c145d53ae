from typing import get_args

from lightning_agentrl.algorithms.estimators import ESTIMATORS
from lightning_agentrl.settings import AlgorithmSettings


def test_every_advantage_setting_names_a_registered_estimator():
    assert set(ESTIMATORS) == set(get_args(AlgorithmSettings.model_fields["advantage"].annotation))
    assert set(ESTIMATORS) == set(AlgorithmSettings._by_tag)  # a settings class for each


def test_every_staleness_weighting_setting_is_a_kind_the_weight_knows():
    from lightning_agentrl.algorithms.staleness import STALENESS_KINDS

    assert set(STALENESS_KINDS) == set(get_args(AlgorithmSettings.model_fields["staleness_weighting"].annotation))


def test_every_importance_level_and_mode_is_one_the_weights_know():
    from lightning_agentrl.algorithms.importance import IMPORTANCE_LEVELS, IMPORTANCE_MODES

    assert set(IMPORTANCE_LEVELS) == set(get_args(AlgorithmSettings.model_fields["importance_level"].annotation))
    assert set(IMPORTANCE_MODES) == set(get_args(AlgorithmSettings.model_fields["importance_mode"].annotation))
