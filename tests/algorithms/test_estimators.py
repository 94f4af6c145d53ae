from typing import get_args

from lightning_agentrl.algorithms.estimators import ESTIMATORS
from lightning_agentrl.settings import AlgorithmSettings


def test_every_advantage_setting_names_a_registered_estimator():
    assert set(ESTIMATORS) == set(get_args(AlgorithmSettings.model_fields["advantage"].annotation))
