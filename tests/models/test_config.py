"""configs/: the documented default file is exactly the defaults; every example decodes; bad keys
fail with their key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from calserve.config import CalserveConfig, load_config
from calserve.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_default_file_mirrors_defaults() -> None:
    assert load_config(CONFIGS / "calserve.yaml") == CalserveConfig()


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_example_decodes(name: str) -> None:
    assert isinstance(load_config(CONFIGS / name), CalserveConfig)


def test_sim_next_example_asks_for_batch_profiles() -> None:
    c = load_config(CONFIGS / "sim-next.yaml")
    assert c.runtime.profile == "sim-next" and c.scheduler.batch.profiles == [1, 4, 8, 16]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("scheduler:\n  queues:\n    decode_wieght: 3\n", r"decode_wieght.*\$\.scheduler\.queues"),
        ("scheduler:\n  queues:\n    decode_weight: 0\n", r"\$\.scheduler\.queues\.decode_weight"),
        ("scheduler:\n  batch:\n    profiles: [2]\n", r"\$\.scheduler\.batch\.profiles\[0\]"),
        ("runtime:\n  profile: calrt-0.8\n", r"\$\.runtime\.profile"),
        ("server:\n  port: eighty\n", r"\$\.server\.port"),
        ("bogus: 1\n", "bogus"),
    ],
)
def test_bad_config_names_key(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(f)


def test_default_alias_is_the_first_model_when_unset(tmp_path: Path) -> None:
    from calserve.config import default_alias

    p = tmp_path / "c.yaml"
    p.write_text("models:\n  m:\n    package: null\n  n:\n    package: null\n")
    c = load_config(p)
    assert c.scheduler.model_alias is None and default_alias(c) == "m"
    p.write_text("scheduler:\n  model_alias: n\nmodels:\n  m: {}\n  n: {}\n")
    assert default_alias(load_config(p)) == "n"
    p.write_text("scheduler:\n  model_alias: x\nmodels:\n  m: {}\n")
    with pytest.raises(ConfigError, match="model_alias"):
        load_config(p)
