"""Settings: every shipped config validates; bad input fails early with the field named."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_agentrl.__main__ import main
from lightning_agentrl.settings import Settings, SettingsError, load_settings, parse_overrides, section_models

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert any(p.name == "smoke.yaml" for p in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_validates_and_opens_with_its_command(config: Path):
    settings = load_settings(config)
    assert isinstance(settings, Settings)
    first = config.read_text().splitlines()[0]
    assert first.startswith(("# python ", "# make ")), f"{config.name} must open with the command that runs it"
    if "lightning_agentrl fit" in first:
        assert f"--config configs/{config.name}" in first


def test_priority_cli_over_env_over_yaml(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("rollout:\n  group_size: 5\n  groups_per_step: 3\n")
    assert load_settings(config).rollout.group_size == 5
    monkeypatch.setenv("AGENTRL_ROLLOUT__GROUP_SIZE", "6")
    assert load_settings(config).rollout.group_size == 6
    settings = load_settings(config, ["--rollout.group_size=8"])
    assert settings.rollout.group_size == 8
    assert settings.rollout.groups_per_step == 3  # merged, not replaced


def test_unknown_key_wrong_type_and_bad_value_are_all_named(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("rollout:\n  group_size: one\n  gruop_size: 4\ntrainer:\n  lr: -1\n")
    with pytest.raises(SettingsError) as err:
        load_settings(config)
    message = str(err.value)
    assert str(config) in message
    assert "rollout.group_size" in message and "'one'" in message
    assert "rollout.gruop_size: Extra inputs are not permitted" in message
    assert "trainer.lr: Input should be greater than 0" in message


def test_inconsistent_combination_is_rejected():
    with pytest.raises(SettingsError, match="algorithm.advantage=gae needs model.value_head=true"):
        load_settings(overrides=["--algorithm.advantage=gae"])
    with pytest.raises(SettingsError, match="rollout.max_in_flight"):
        load_settings(overrides=["--rollout.max_in_flight=2", "--rollout.group_size=4"])


def test_unknown_section_and_missing_file():
    with pytest.raises(SettingsError, match="nosuch: Extra inputs are not permitted"):
        load_settings(overrides=["--nosuch.field=1"])
    with pytest.raises(SettingsError, match="config file not found"):
        load_settings("does/not/exist.yaml")


def test_override_parsing():
    assert parse_overrides(["--a.b=1", "--a.c", "true", "--d.e=null"]) == {"a": {"b": 1, "c": True}, "d": {"e": None}}
    with pytest.raises(SettingsError, match="overrides look like --section.field=value"):
        parse_overrides(["positional"])


def test_cli_validate_exits_2_with_the_field_named(capsys):
    assert main(["validate", "--rollout.group_size=0"]) == 2
    assert "rollout.group_size: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_fit_help_lists_every_field_with_its_doc():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_agentrl", "fit", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for section in Settings.model_fields:
        for model in section_models(section):
            for name, info in model.model_fields.items():
                assert f"--{section}.{name} " in out
                if name == getattr(model, "_tag", None):  # a variant's tag: documented once, on the section
                    continue
                assert info.description and info.description in out, f"{section}.{name} has no docstring"
    assert "[engine, kind: vllm_server]" in out and "[algorithm, advantage: gigpo]" in out


def test_a_step_must_split_into_whole_groups_per_process():
    with pytest.raises(SettingsError, match=r"groups_per_step \(2\) must be a multiple .*\(4\)"):
        load_settings(overrides=["--trainer.devices=2", "--trainer.num_nodes=2", "--rollout.groups_per_step=2"])
    assert load_settings(overrides=["--trainer.devices=2", "--rollout.groups_per_step=4"]).trainer.num_nodes == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--rollout.partial_rollout_s=0", "--rollout.max_staleness=0"],
         "rollout.partial_rollout_s needs rollout.max_staleness >= 1"),
        (["--trainer.sync_weights_every=2", "--rollout.max_staleness=0"],
         r"trainer.sync_weights_every \(2\) needs rollout.max_staleness >= 1"),
        (["--trainer.sync_weights_every=3", "--rollout.max_staleness=1"],
         r"trainer.sync_weights_every \(3\) needs rollout.max_staleness >= 2 \(it is 1\)"),
    ],
)
def test_rollout_rules_that_cannot_run_are_refused_before_anything_starts(overrides, message, capsys):
    with pytest.raises(SettingsError, match=message):
        load_settings(overrides=overrides)
    assert main(["validate", *overrides]) == 2
    assert "rollout.max_staleness" in capsys.readouterr().err


def test_weights_pushed_every_k_steps_run_with_a_staleness_of_k_minus_1():
    settings = load_settings(overrides=["--trainer.sync_weights_every=3", "--rollout.max_staleness=2"])
    assert settings.trainer.sync_weights_every == 3


def test_training_refuses_greedy_sampling_but_evaluation_may_be_greedy():
    with pytest.raises(SettingsError, match="engine.temperature: Input should be greater than 0"):
        load_settings(overrides=["--engine.temperature=0"])
    assert load_settings(overrides=["--eval.temperature=0"]).eval.temperature == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--engine.top_k=1"], "engine.top_k=1 samples the most likely token only"),
        (["--engine.top_k=true"], "engine.top_k must be a count of tokens"),
        (["--trainer.adam_eps=1e-300"], r"trainer.adam_eps \(1e-300\) rounds to 0 in model.dtype=float32"),
        (["--model.dtype=float16"], r"trainer.adam_eps \(1e-08\) rounds to 0 in model.dtype=float16"),
        (["--engine.logprobs=softmax", "--engine.kind=vllm"], "engine.logprobs=softmax needs engine.kind=torch"),
        (["--engine.logprobs=filtered"], "engine.logprobs: Input should be 'sampler' or 'softmax'"),
        # an update that overflows float32 (a traceback inside AdamW, or NaN weights saved) is refused here
        (["--trainer.lr=inf"], "trainer.lr"),
        (["--trainer.lr=1e39"], "trainer.lr"),
        (["--trainer.weight_decay=inf"], "trainer.weight_decay"),
        (["--sft.lr=nan"], "sft.lr"),
        (["--engine.admission_window_ms=inf"], "engine.admission_window_ms"),
        (["--engine.admission_window_ms=nan"], "engine.admission_window_ms"),
        (["--engine.kind=vllm_server", "--engine.urls=[http://127.0.0.1:8000]", "--engine.dtype=bfloat16"],
         "engine.dtype=bfloat16 cannot reach servers in engine.urls"),
    ],
)
def test_sampling_and_optimizer_values_that_cannot_train_are_refused(overrides, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(overrides=overrides)


def test_top_k_and_adam_eps_that_can_train_are_accepted():
    settings = load_settings(overrides=["--engine.top_k=2", "--model.dtype=float16", "--trainer.adam_eps=1e-4"])
    assert (settings.engine.top_k, settings.trainer.adam_eps) == (2, 1e-4)


@pytest.mark.parametrize("role", ["assistant", "system", "bogus"])
def test_an_observation_role_that_is_not_a_tool_results_role_is_refused(role):
    with pytest.raises(ValueError, match="env.observation_role"):
        load_settings(overrides=[f"--env.observation_role={role}"])


def test_an_unknown_precision_is_refused_before_any_model_loads():
    with pytest.raises(SettingsError, match=r"trainer.precision: Input should be '32-true'.*\(got 'bogus'\)"):
        load_settings(overrides=["--trainer.precision=bogus"])
    assert load_settings(overrides=["--trainer.precision=bf16-mixed"]).trainer.precision == "bf16-mixed"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--algorithm.importance_mode=mask", "--algorithm.importance_cap=null"],
         "importance_mode=mask needs algorithm.importance_cap"),
        (["--algorithm.importance_level=sequence", "--algorithm.importance_cap=null"],
         "importance_level=sequence needs algorithm.importance_cap"),
        (["--algorithm.importance_lower=0.5"], "importance_lower applies to algorithm.importance_mode=mask only"),
        (["--algorithm.importance_mode=mask", "--algorithm.importance_lower=3", "--algorithm.importance_cap=2"],
         r"importance_lower \(3\) must be below algorithm.importance_cap \(2\)"),
        (["--algorithm.importance_level=episode"], "importance_level: Input should be 'token', 'sequence' or"),
        (["--algorithm.importance_mode=mask", "--algorithm.importance_cap=1"],
         r"importance_lower \(1 \(unset, it is 1 / importance_cap\)\) must be below algorithm.importance_cap \(1\)"),
        (["--algorithm.importance_level=sequence", "--algorithm.loss_mask=false"],
         "importance_level=sequence needs algorithm.loss_mask=true"),
    ],
)
def test_importance_combinations_that_cannot_run_are_refused_by_name(overrides, message, capsys):
    with pytest.raises(SettingsError, match=message):
        load_settings(overrides=overrides)
    assert main(["validate", *overrides]) == 2
    assert "algorithm.importance_" in capsys.readouterr().err


def test_mode_none_needs_no_cap_at_the_sequence_levels_but_refuses_a_lower_bound():
    settings = load_settings(overrides=["--algorithm.importance_level=sequence", "--algorithm.importance_mode=none",
                                        "--algorithm.importance_cap=null"])
    assert (settings.algorithm.importance_mode, settings.algorithm.importance_floor) == ("none", None)
    with pytest.raises(SettingsError, match="importance_lower applies to algorithm.importance_mode=mask only"):
        load_settings(overrides=["--algorithm.importance_mode=none", "--algorithm.importance_lower=0.5"])
    with pytest.raises(SettingsError, match="importance_cap=2 applies to importance_mode truncate or mask"):
        load_settings(overrides=["--algorithm.importance_mode=none", "--algorithm.importance_cap=2"])


def test_a_mask_without_a_lower_bound_uses_the_reciprocal_of_the_cap():
    settings = load_settings(overrides=["--algorithm.importance_mode=mask", "--algorithm.importance_cap=4"])
    assert settings.algorithm.importance_floor == 0.25
    assert load_settings().algorithm.importance_floor is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--rollout.group_size=1"], "rollout.group_size=1 leaves algorithm.advantage=grpo without a baseline"),
        (["--rollout.group_size=1", "--algorithm.advantage=gae", "--model.value_head=true",
          "--rollout.dynamic_sampling=true"], "rollout.group_size=1: rollout.dynamic_sampling"),
        (["--algorithm.gae_level=token"], "algorithm.gae_level applies to algorithm.advantage=gae only"),
    ],
)
def test_critic_settings_that_cannot_run_are_refused_by_name(overrides, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(overrides=overrides)


# Variant sections: `engine` by kind, `algorithm` by advantage (each variant a class with its own fields).
VARIANTS = {
    "torch": ["--engine.kind=torch"], "vllm": ["--engine.kind=vllm"],
    "vllm_server": ["--engine.kind=vllm_server", "--engine.urls=[\"http://127.0.0.1:8000\"]"],
    "grpo": ["--algorithm.advantage=grpo", "--algorithm.grpo_std=sample"], "rloo": ["--algorithm.advantage=rloo"],
    "reinforce_decay": ["--algorithm.advantage=reinforce_decay"],
    "gigpo": ["--algorithm.advantage=gigpo", "--algorithm.gigpo_similarity=0.8"],
    "gae": ["--algorithm.advantage=gae", "--algorithm.gae_level=token", "--model.value_head=true"],
    "importance none": ["--algorithm.importance_mode=none"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_run_settings_file_of_every_variant_loads_back_as_the_same_settings(variant, tmp_path):
    """What `--resume last` and `evaluate RUN_DIR` do with a run's settings.yaml (a complete dump)."""
    import yaml

    settings = load_settings(overrides=VARIANTS[variant])
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
    assert load_settings(path) == settings


def test_a_settings_file_written_before_the_variants_had_classes_still_loads(tmp_path):
    """Such a file lists every field of every variant at its default beside the run's own (a vLLM run here,
    with GiGPO): those defaults are dropped, the run's values kept."""
    import yaml

    every = {"engine": {}, "algorithm": {}}
    for section in every:
        for model in section_models(section):
            every[section].update(model().model_dump(mode="json"))
    every["engine"].update(kind="vllm", num_replicas=2)
    every["algorithm"].update(advantage="gigpo", gigpo_omega=0.5)
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump(every))
    settings = load_settings(path)
    assert (settings.engine.kind, settings.engine.num_replicas) == ("vllm", 2)
    assert (settings.algorithm.advantage, settings.algorithm.gigpo_omega) == ("gigpo", 0.5)
    assert not hasattr(settings.engine, "max_batch_size") and not hasattr(settings.algorithm, "gae_level")


@pytest.mark.parametrize(("overrides", "message"), [
    (["--engine.kind=vllm", "--engine.max_batch_size=64"],
     r"^  engine.max_batch_size applies to engine.kind=torch only \(engine.kind is 'vllm'\)$"),
    (["--engine.num_replicas=2"], r"engine.num_replicas applies to engine.kind=vllm only \(engine.kind is 'torch'\)"),
    (["--engine.kind=vllm", "--engine.urls=[\"http://h:1\"]"], "engine.urls applies to engine.kind=vllm_server only"),
    (["--engine.vllm_kv_cache_bytes=1073741824"], "engine.vllm_kv_cache_bytes applies to engine.kind=vllm or vllm_server"),
    (["--algorithm.advantage=rloo", "--algorithm.grpo_std=none"], "algorithm.grpo_std applies to algorithm.advantage=grpo"),
    (["--algorithm.gigpo_omega=2"], r"algorithm.gigpo_omega applies to algorithm.advantage=gigpo only \(algorithm.adv"),
    (["--engine.kind=sglang"], r"^  engine.kind must be one of torch, vllm, vllm_server \(got 'sglang'\)$"),
    (["--algorithm.advantage=ppo"], r"algorithm.advantage must be one of grpo, rloo, reinforce_decay, gigpo, gae"),
    (["--engine.kind=vllm", "--engine.nope=1"], r"^  engine.nope: Extra inputs are not permitted \(got 1\)$"),
])
def test_a_field_of_another_variant_is_refused_by_name(overrides, message):
    with pytest.raises(SettingsError) as err:
        load_settings(overrides=overrides)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and re.search(message, lines[0]), lines


def test_a_variant_is_chosen_by_environment_variable_too(monkeypatch):
    monkeypatch.setenv("AGENTRL_ENGINE__KIND", "vllm_server")
    monkeypatch.setenv("AGENTRL_ENGINE__NUM_SERVERS", "3")
    monkeypatch.setenv("AGENTRL_ALGORITHM__ADVANTAGE", "gigpo")
    settings = load_settings(overrides=["--algorithm.gigpo_omega=0.25"])
    assert type(settings.engine).__name__ == "VLLMServerSettings" and settings.engine.num_servers == 3
    assert (settings.algorithm.advantage, settings.algorithm.gigpo_omega) == ("gigpo", 0.25)
    assert settings.engine.fleet_urls == [] and load_settings().engine.fleet_urls == []


def test_the_plans_built_from_settings_default_to_the_settings_defaults():
    """RolloutPlan and EpisodeBudget copy fields of their sections by name: their defaults are the sections'."""
    import dataclasses

    from lightning_agentrl.rollout.agent_loop import EpisodeBudget
    from lightning_agentrl.rollout.service import RolloutPlan
    from lightning_agentrl.settings import EnvSettings, RolloutSettings

    for plan, section in ((RolloutPlan, RolloutSettings), (EpisodeBudget, EnvSettings)):
        for field in dataclasses.fields(plan):
            if field.default is not dataclasses.MISSING and field.name in section.model_fields:
                assert field.default == section.model_fields[field.name].default, (plan.__name__, field.name)
    assert RolloutPlan(1, 1, 1, 0).max_sampling_rounds == RolloutSettings().max_sampling_rounds == 4


def test_an_override_that_switches_the_variant_drops_the_files_fields_of_the_old_one(tmp_path, monkeypatch):
    """`evaluate RUN_DIR --engine.kind=vllm` on a torch run, a resume that changes the estimator, a GPU recipe's
    smoke run on the torch engine: the file's fields of the kind it no longer is do not apply; fields given
    beside the new tag are still checked."""
    config = tmp_path / "run.yaml"
    config.write_text("engine: {kind: torch, max_batch_size: 32}\nalgorithm: {advantage: grpo, grpo_std: none}\n")
    settings = load_settings(config, ["--engine.kind=vllm", "--algorithm.advantage=rloo"])
    assert (settings.engine.kind, settings.algorithm.advantage) == ("vllm", "rloo")
    with pytest.raises(SettingsError, match="engine.max_batch_size applies to engine.kind=torch only"):
        load_settings(config, ["--engine.kind=vllm", "--engine.max_batch_size=8"])
    with pytest.raises(SettingsError, match="algorithm.grpo_std applies to algorithm.advantage=grpo only"):
        load_settings(tmp_path / "run.yaml", ["--algorithm.grpo_std=sample", "--algorithm.advantage=gigpo"])
    assert load_settings(REPO / "configs" / "gpu_zero2.yaml", ["--engine.kind=torch"]).engine.max_batch_size == 16
    monkeypatch.setenv("AGENTRL_ENGINE__KIND", "vllm_server")
    assert load_settings(config).engine.kind == "vllm_server"
    monkeypatch.setenv("AGENTRL_ENGINE__KIND", "torch")
    assert load_settings(config).engine.max_batch_size == 32  # not switched: the file's own value


def test_evaluation_of_a_torch_run_on_vllm_reads_the_runs_settings_file(tmp_path):
    import yaml

    from lightning_agentrl.evaluate import evaluation_settings

    run = tmp_path / "run"
    (run / "policy").mkdir(parents=True)
    (run / "policy" / "config.json").write_text("{}")
    dump = load_settings(overrides=["--engine.max_batch_size=32", "--algorithm.grpo_std=sample"]).model_dump(mode="json")
    (run / "settings.yaml").write_text(yaml.safe_dump(dump))
    _, settings = evaluation_settings(run, split="test", samples=1, config=None, overrides=["--engine.kind=vllm"],
                                      out=tmp_path / "out")
    assert settings.engine.kind == "vllm" and settings.algorithm.grpo_std == "sample"


def test_a_gpu_vllm_runs_settings_file_loads_back(tmp_path):
    """Its dump holds `vllm_kv_cache_bytes: null`, which is not setting it."""
    import yaml

    settings = load_settings(REPO / "configs" / "gpu_zero2.yaml")
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
    assert load_settings(path) == settings
    with pytest.raises(SettingsError, match="engine.vllm_kv_cache_bytes applies to vLLM on CPU only"):
        load_settings(path, ["--engine.vllm_kv_cache_bytes=1073741824"])


@pytest.mark.parametrize(("text", "line"), [
    ("engine: null\n", "  engine: must be a mapping of the section's fields (got None)"),
    ("algorithm: gae\n", "  algorithm: must be a mapping of the section's fields (got 'gae')"),
])
def test_a_variant_section_that_is_not_a_mapping_says_so(text, line, tmp_path):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(SettingsError) as err:
        load_settings(tmp_path / "c.yaml")
    assert str(err.value).splitlines()[1:] == [line]


def test_another_variants_field_at_its_default_counts_as_its_type_reads_it(monkeypatch):
    monkeypatch.setenv("AGENTRL_ENGINE__MAX_BATCH_SIZE", "16")  # an environment variable is a string
    assert load_settings(overrides=["--engine.kind=vllm"]).engine.kind == "vllm"
    monkeypatch.setenv("AGENTRL_ENGINE__MAX_BATCH_SIZE", "17")
    with pytest.raises(SettingsError, match="engine.max_batch_size applies to engine.kind=torch only"):
        load_settings(overrides=["--engine.kind=vllm"])


def test_every_comparison_arm_loads_on_its_config():
    """The arms are overrides of settings paths: a variant's field in the wrong arm would stop a comparison."""
    from benchmarks.compare import COMPARISONS
    from lightning_agentrl.settings import flatten_dict

    for name, spec in COMPARISONS.items():
        config = REPO / spec.get("config", f"configs/compare_{name}.yaml")
        for arm, overrides in spec["arms"].items():
            loaded = load_settings(config, [*spec.get("common", []), *overrides]).model_dump(mode="json")
            for dotted, value in flatten_dict(parse_overrides(overrides)).items():  # each arm's setting took effect
                section, field = dotted.split(".")
                assert str(loaded[section][field]) in (value, f"{value}.0"), (name, arm, dotted)
