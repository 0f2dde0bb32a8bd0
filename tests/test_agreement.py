"""Decisions that lead to a collective are taken once and agreed across ranks: the newest
checkpoint a rollback reloads and the checkpoint a run resumes from (a filesystem that caches listings
can show ranks different folders), the Hub check (rank 0 alone asks), and the gloo side group's network
interface on NCCL jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlm_ddp.cluster.collectives import gloo_interface
from mlm_ddp.config import RunConfig
from mlm_ddp.errors import BadInput
from tests.conftest import CONFIGS, LAUNCH, free_port, run_module


def test_ranks_with_different_views_of_the_folder_agree_on_rank_0s_checkpoint_or_stop(tmp_path: Path) -> None:
    proc = run_module([*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--num_processes", "2",
                       "--main_process_port", str(free_port()), "-m", "tests.agreement_driver", str(tmp_path)],
                      env={"ACCELERATE_USE_CPU": "true"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["own"] for r in lines] == ["step-0000004", "step-0000002"]  # what each rank's listing says
    # a rollback reloads what rank 0 found, on both
    assert [(r["agreed"], r["agreed_step"]) for r in lines] == [("step-0000004", 4)] * 2
    # a resume from different checkpoints stops on every rank, naming both views
    for record in lines:
        assert "found different checkpoints to resume from" in record["refused"]
        assert "rank 0: " in record["refused"] and "step-0000004" in record["refused"]
        assert "rank 1: " in record["refused"] and "step-0000002" in record["refused"]


def test_only_the_uploading_rank_asks_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    from mlm_ddp.run import hub

    asked: list[str] = []
    monkeypatch.setattr(hub, "offline", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda self: asked.append("whoami") or {"name": "me"})
    run = RunConfig(output_dir="/tmp/run-name", push_to_hub=True)
    assert hub.check_hub(run, uploads=False) is None and asked == []
    assert hub.check_hub(run, uploads=True) == "me/run-name" and asked == ["whoami"]
    monkeypatch.setattr(hub, "offline", lambda: True)  # switched off: refused on every rank, uploading or not
    with pytest.raises(BadInput, match="HF_HUB_OFFLINE"):
        hub.check_hub(run, uploads=False)


HOST = ["lo", "eth0", "eth1", "ib0", "docker0"]


@pytest.mark.parametrize(("env", "backend", "expected"), [
    ({}, "nccl", None),  # nothing said: gloo's own choice
    ({"NCCL_SOCKET_IFNAME": "ib"}, "nccl", "ib0"),  # a prefix, as NCCL reads it
    ({"NCCL_SOCKET_IFNAME": "=eth1"}, "nccl", "eth1"),  # an exact name
    ({"NCCL_SOCKET_IFNAME": "ib,eth"}, "nccl", "eth0"),  # the first interface of this host that matches
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, "nccl", None),  # exclusions name no interface
    ({"NCCL_SOCKET_IFNAME": "ib"}, "gloo", None),  # a CPU job: NCCL's variable does not apply
    ({"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth1"}, "nccl", "eth1"),  # the user's own wins
    ({"GLOO_SOCKET_IFNAME": "eth0"}, "gloo", "eth0"),
])
def test_the_gloo_side_group_takes_the_network_nccl_was_told_to_take(env: dict, backend: str,
                                                                     expected: str | None) -> None:
    assert gloo_interface(env, backend, HOST) == expected


@pytest.mark.parametrize(("env", "named"), [
    ({"NCCL_SOCKET_IFNAME": "ens"}, "NCCL_SOCKET_IFNAME=ens: no interface of"),
    ({"NCCL_SOCKET_IFNAME": "=eth"}, "NCCL_SOCKET_IFNAME==eth: no interface of"),  # exact: eth0 is not eth
    ({"GLOO_SOCKET_IFNAME": "eth0,ens5"}, "GLOO_SOCKET_IFNAME=eth0,ens5: .* has no interface ens5"),
])
def test_an_interface_the_host_lacks_is_refused_naming_the_variable(env: dict, named: str) -> None:
    with pytest.raises(BadInput, match=named) as err:
        gloo_interface(env, "nccl", HOST)
    assert "lo, eth0, eth1, ib0, docker0" in str(err.value)


def test_ranks_that_would_choose_other_precisions_train_in_rank_0s_and_rank_0_names_them(
        caplog: pytest.LogCaptureFixture) -> None:
    """`auto` on GPUs of two generations: four ranks, two of which would pick fp16; all take rank 0's bf16,
    and rank 0 says, in one line, which two. Every rank's choice comes from the start-up group's gather
    (here, what it returns: each rank's own value in rank order)."""
    from accelerate import PartialState

    from mlm_ddp.cluster.precision import agree_precision

    PartialState(cpu=True)  # accelerate's logger needs its state
    own = {0: ("bf16", "auto: compute capability 9.0"), 1: ("fp16", "auto: compute capability 7.0"),
           2: ("bf16", "auto: compute capability 9.0"), 3: ("fp16", "auto: compute capability 7.5")}
    every = [[*own[r], f"node{r}"] for r in range(4)]
    with caplog.at_level("WARNING"):
        agreed = {r: agree_precision(own[r], r, lambda mine, r=r: [mine if i == r else v for i, v in enumerate(every)])
                  for r in range(4)}
    assert agreed == {r: own[0] for r in range(4)}
    lines = [rec.getMessage() for rec in caplog.records if "would have chosen otherwise" in rec.getMessage()]
    assert len(lines) == 1 and "2 rank(s) would have chosen otherwise: rank 1 on " in lines[0], lines
    assert " fp16, rank 3 on " in lines[0] and "precision bf16 for every rank (rank 0's: auto" in lines[0]

